"""The SDK's reading of a framed download (`Accept:
application/vnd.forkbox.frames`), against frames built here. Needs no
daemon and no VM: run it alone with
`python3 -m pytest sdk/python/tests/test_download_frames.py`. The daemon's
side is tested in forkboxd's `api::files` tests, both together in
`test_faults.py`."""

from __future__ import annotations

import json

import httpx
import pytest

from forkbox import (DownloadInterruptedError, GuestTimeoutError, InfrastructureError,
                     TooLargeError)
from forkbox._client import _Frames


def _frame(kind: int, payload: bytes) -> bytes:
    return bytes([kind]) + len(payload).to_bytes(4, "big") + payload


def _response() -> httpx.Response:
    return httpx.Response(200, request=httpx.Request("GET", "http://forkboxd/f"))


def _read(body: bytes, step: int) -> _Frames:
    frames = _Frames()
    for i in range(0, len(body), step):
        frames.feed(body[i:i + step])
    return frames


@pytest.mark.parametrize("step", [1, 3, 7, 1 << 20])
def test_data_then_end_is_the_whole_body_however_it_is_split(step: int) -> None:
    body = _frame(0, b"hello ") + _frame(0, b"") + _frame(0, b"world") + _frame(1, b"")
    assert _read(body, step).result(_response()).content == b"hello world"


def test_a_failure_frame_raises_what_the_daemon_said() -> None:
    why = {"status": 413, "error": {"kind": "too_large", "message": "over 1048576 bytes",
                                    "infrastructure": False}}
    frames = _read(_frame(0, b"x" * 10) + _frame(2, json.dumps(why).encode()), 4)
    with pytest.raises(TooLargeError) as caught:
        frames.result(_response())
    assert (caught.value.status, caught.value.infrastructure) == (413, False)
    why = {"status": 504, "error": {"kind": "guest_timeout", "message": "no answer",
                                    "infrastructure": False}}
    with pytest.raises(GuestTimeoutError):
        _read(_frame(2, json.dumps(why).encode()), 5).result(_response())


@pytest.mark.parametrize("body", [b"", _frame(0, b"abc"), _frame(0, b"abc")[:6]])
def test_a_body_without_its_end_is_interrupted_infrastructure(body: bytes) -> None:
    with pytest.raises(DownloadInterruptedError) as caught:
        _read(body, 2).result(_response())
    assert isinstance(caught.value, InfrastructureError) and caught.value.infrastructure
    # Once the end came, a connection that breaks after it loses nothing.
    whole = _read(_frame(0, b"abc") + _frame(1, b""), 2)
    assert whole.result(_response(), httpx.ReadError("reset")).content == b"abc"


def test_a_daemon_older_than_frames_is_read_raw() -> None:
    r = httpx.Response(200, headers={"content-type": "application/octet-stream"},
                       request=httpx.Request("GET", "http://forkboxd/f"))
    frames = _Frames(r)
    for part in (b"\x01\x00\x00", b"\x00\x00 raw"):
        frames.feed(part)
    assert frames.result(r).content == b"\x01\x00\x00\x00\x00 raw"
    with pytest.raises(DownloadInterruptedError):
        _Frames(r).result(r, httpx.ReadError("reset"))
