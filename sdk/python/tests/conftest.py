"""Starts a real forkboxd for the session (VMs need KVM: run the session
inside the emulated host where this machine lacks VMX/SVM, as
`make sdk-test` does)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest

SDK = Path(__file__).resolve().parents[1]
REPO = SDK.parents[1]
sys.path.insert(0, str(SDK))

import httpx  # noqa: E402

import testbed_shard  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # A shard of `forkbox testbed run --shards N` (testbed_shard.py).
    testbed_shard.register(config)

# Room for a parent and a fork of 16 plus what the other tests keep live.
MAX_LIVE = 24
# The cap test's own daemon: small enough to fill.
SMALL_MAX_LIVE = 2


@contextlib.contextmanager
def _forkboxd(max_live: int, tcp_port: Optional[int] = None,
              token: Optional[str] = None, extra: Sequence[str] = ()) -> Iterator[str]:
    """A forkboxd on a fresh unix socket (or on 127.0.0.1:`tcp_port`,
    which needs `token`); its URL. The log tail goes to stderr at the
    end."""
    # /tmp: the emulated host mounts everything else read-only.
    d = tempfile.mkdtemp(prefix="forkboxd-test-", dir="/tmp")
    sock = os.path.join(d, "forkbox.sock")
    exe = os.environ.get("FORKBOXD") or str(REPO / "target" / "release" / "forkboxd")
    log = open(os.path.join(d, "forkboxd.log"), "w+b")
    if tcp_port is None:
        listen = [f"unix://{sock}"]
    else:
        listen = [f"tcp://127.0.0.1:{tcp_port}", "--state-dir", os.path.join(d, "state")]
    proc = subprocess.Popen(
        [exe, "--listen", *listen, "--max-live", str(max_live), "--create-wait", "0",
         *(["--token", token] if token else []), *extra],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"forkboxd exited with {proc.returncode}:\n{log.read().decode()}")
        if tcp_port is not None or os.path.exists(sock):
            try:
                if tcp_port is None:
                    transport = httpx.HTTPTransport(uds=sock)
                    health = "http://forkboxd/health"
                else:
                    transport = httpx.HTTPTransport()
                    health = f"http://127.0.0.1:{tcp_port}/health"
                with httpx.Client(transport=transport, trust_env=False) as c:
                    if c.get(health).status_code == 200:
                        break
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("forkboxd did not come up within 120 s")
        time.sleep(0.05)
    try:
        yield f"unix://{sock}" if tcp_port is None else f"http://127.0.0.1:{tcp_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.seek(0)
        sys.stderr.write(f"--- forkboxd (max-live {max_live}) log ---\n"
                         + log.read().decode(errors="replace")[-4000:])


@pytest.fixture(scope="session")
def daemon_url() -> Iterator[str]:
    """The session's daemon; the SDK finds it through FORKBOX_URL."""
    with _forkboxd(MAX_LIVE) as url:
        os.environ["FORKBOX_URL"] = url
        yield url


@pytest.fixture(scope="module")
def small_daemon_url() -> Iterator[str]:
    """A second daemon whose live cap is SMALL_MAX_LIVE (pass `url=`)."""
    with _forkboxd(SMALL_MAX_LIVE) as url:
        yield url
