"""The HTTP connection to forkboxd: where it is, and error translation.

`Client` (blocking) and `AsyncClient` (asyncio) share the URL handling,
the error translation and the NDJSON line parsing; they differ only in
how they wait.
"""

from __future__ import annotations

import asyncio
import json
import os
import weakref
from typing import Any, Dict, Optional, Protocol, Tuple, TypeVar

import httpx

from .exceptions import DaemonUnavailableError, ForkboxError, from_cut_download, from_response

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class EventReader(Protocol[T_co]):
    """What reads a stream of events (`_api.CommandStream`,
    `_api.BakeStream`): `feed` answers the result once there is one."""

    def feed(self, ev: Dict[str, Any]) -> Optional[T_co]: ...

    def ended(self) -> Exception: ...

DEFAULT_ROOT_SOCKET = "/run/forkbox/forkbox.sock"


def default_url() -> str:
    """`FORKBOX_URL`, else the daemon's default socket: /run/forkbox as
    root, else under $XDG_RUNTIME_DIR."""
    url = os.environ.get("FORKBOX_URL")
    if url:
        return url
    if os.geteuid() == 0:
        return "unix://" + DEFAULT_ROOT_SOCKET
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return "unix://" + os.path.join(xdg, "forkbox", "forkbox.sock")
    return "unix://" + DEFAULT_ROOT_SOCKET


def _endpoint(url: str) -> Tuple[Optional[str], str]:
    """(unix socket path or None, base URL) of a daemon URL."""
    if url.startswith("unix://"):
        return url[len("unix://"):], "http://forkboxd"
    if url.startswith(("http://", "https://")):
        return None, url.rstrip("/")
    raise ValueError(f"FORKBOX_URL {url!r}: expected unix:///path or http://host:port")


def _headers(token: Optional[str]) -> Dict[str, str]:
    token = token if token is not None else os.environ.get("FORKBOX_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _unavailable(url: str, e: Exception) -> DaemonUnavailableError:
    return DaemonUnavailableError(f"cannot reach forkboxd at {url}: {e}", "infrastructure")


def _error_of(r: httpx.Response) -> ForkboxError:
    """The SDK error for an error response whose body has been read."""
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return from_response(r.status_code, body)


FRAMES = "application/vnd.forkbox.frames"
_FRAME_DATA, _FRAME_END, _FRAME_FAILED = 0, 1, 2


class _Frames:
    """Reads a framed download (`Accept: application/vnd.forkbox.frames`):
    frames of a kind byte, a 4-byte big-endian length and the payload,
    data frames then one end (`1`) or failure (`2`, JSON `{"status": N,
    "error": {…}}`). The daemon says how a download ended, so a cut is
    never guessed from the bytes that came."""

    def __init__(self, r: Optional[httpx.Response] = None) -> None:
        self._buf = bytearray()
        self._data: "list[bytes]" = []
        self.received = 0
        self._end: Optional[ForkboxError] = None
        self._ended = False
        # A daemon older than frames answers with the bytes themselves.
        ctype = r.headers.get("content-type", FRAMES) if r is not None else FRAMES
        self._raw = ctype.split(";")[0].strip() != FRAMES

    def feed(self, chunk: bytes) -> None:
        if self._raw:
            self._data.append(chunk)
            self.received += len(chunk)
            return
        self._buf += chunk
        while not self._ended and len(self._buf) >= 5:
            kind, n = self._buf[0], int.from_bytes(self._buf[1:5], "big")
            if len(self._buf) < 5 + n:
                return
            payload = bytes(self._buf[5:5 + n])
            del self._buf[:5 + n]
            if kind == _FRAME_DATA:
                self._data.append(payload)
                self.received += n
            elif kind == _FRAME_END:
                self._ended = True
            elif kind == _FRAME_FAILED:
                body = json.loads(payload)
                self._end = from_response(int(body.get("status", 500)), body)
                self._ended = True
            else:
                raise ForkboxError(f"a download frame of unknown kind {kind}: is the daemon newer "
                                   "than this SDK?", "protocol")

    def result(self, r: httpx.Response, cut: Optional[Exception] = None) -> httpx.Response:
        """The download as one response, its body read; or the error its
        last frame names; or `DownloadInterruptedError` when it never came
        (`cut`: the transport's error, if one ended the body)."""
        if self._end is not None:
            raise self._end
        if self._raw and cut is None:
            self._ended = True
        if not self._ended:
            raise from_cut_download(self.received) from cut
        return httpx.Response(r.status_code, headers=r.headers, content=b"".join(self._data),
                              request=r.request)


def _download_headers(kw: Dict[str, Any]) -> Dict[str, Any]:
    headers = dict(kw.pop("headers", {}))
    headers["Accept"] = FRAMES
    return headers


def _ndjson_line(line: str) -> Optional[Dict[str, Any]]:
    return json.loads(line) if line.strip() else None


def _stream_headers(kw: Dict[str, Any]) -> Dict[str, Any]:
    headers = dict(kw.pop("headers", {}))
    headers["Accept"] = "application/x-ndjson"
    return headers


def _timeout(timeout: float) -> httpx.Timeout:
    return httpx.Timeout(timeout, connect=10.0)


class Client:
    """A blocking connection pool to one daemon (`unix:///path` or
    `http://host:port`). Safe to share between threads."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 600.0) -> None:
        self.url = url or default_url()
        uds, base = _endpoint(self.url)
        transport = httpx.HTTPTransport(uds=uds) if uds else httpx.HTTPTransport()
        self._http = httpx.Client(base_url=base, transport=transport, headers=_headers(token),
                                  timeout=_timeout(timeout))

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise _unavailable(self.url, e) from e
        if r.status_code >= 400:
            raise _error_of(r)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        r = self.request(method, path, **kw)
        return r.json() if r.content else None

    def download(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """A file read or tar download: its response, whole, its body the
        file's or archive's bytes. One that fails after its answer started
        raises what the daemon said (`TooLargeError` at its limit,
        `GuestTimeoutError`, an `InfrastructureError` if its VM died); a
        body that stops before the daemon said how it ended is
        `DownloadInterruptedError`, never `DaemonUnavailableError`."""
        headers = _download_headers(kw)
        try:
            with self._http.stream(method, path, headers=headers, **kw) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error_of(r)
                frames = _Frames(r)
                try:
                    for c in r.iter_bytes():
                        frames.feed(c)
                except httpx.TransportError as e:
                    return frames.result(r, e)
                return frames.result(r)
        except httpx.TransportError as e:
            raise _unavailable(self.url, e) from e

    def follow_ndjson(self, method: str, path: str, reader: "EventReader[T]", **kw: Any) -> T:
        """Feeds each event of an NDJSON stream to `reader.feed` until it
        returns a result, which is returned; a stream that ends first raises
        `reader.ended()`. The response is closed before this returns or
        raises: a streaming
        response left to the garbage collector is closed whenever the
        collector runs, which may be while this thread holds httpcore's
        pool lock, and that thread then waits for itself forever
        (encode/httpcore#990; seen here as a test stalled 10 minutes)."""
        headers = _stream_headers(kw)
        try:
            with self._http.stream(method, path, headers=headers, **kw) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error_of(r)
                for line in r.iter_lines():
                    ev = _ndjson_line(line)
                    if ev is not None:
                        result = reader.feed(ev)
                        if result is not None:
                            return result
        except httpx.TransportError as e:
            raise _unavailable(self.url, e) from e
        raise reader.ended()


class AsyncClient:
    """An asyncio connection pool to one daemon. Bound to the event loop
    it is first used on (httpx's rule); `shared_async_client` keeps one
    per loop."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 600.0) -> None:
        self.url = url or default_url()
        uds, base = _endpoint(self.url)
        transport = httpx.AsyncHTTPTransport(uds=uds) if uds else httpx.AsyncHTTPTransport()
        self._http = httpx.AsyncClient(base_url=base, transport=transport,
                                       headers=_headers(token), timeout=_timeout(timeout))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise _unavailable(self.url, e) from e
        if r.status_code >= 400:
            raise _error_of(r)
        return r

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        r = await self.request(method, path, **kw)
        return r.json() if r.content else None

    async def download(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """As `Client.download`."""
        headers = _download_headers(kw)
        try:
            async with self._http.stream(method, path, headers=headers, **kw) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise _error_of(r)
                frames = _Frames(r)
                try:
                    async for c in r.aiter_bytes():
                        frames.feed(c)
                except httpx.TransportError as e:
                    return frames.result(r, e)
                return frames.result(r)
        except httpx.TransportError as e:
            raise _unavailable(self.url, e) from e

    async def follow_ndjson(self, method: str, path: str, reader: "EventReader[T]",
                            **kw: Any) -> T:
        """As `Client.follow_ndjson`: the response is closed before this
        returns or raises."""
        headers = _stream_headers(kw)
        try:
            async with self._http.stream(method, path, headers=headers, **kw) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise _error_of(r)
                async for line in r.aiter_lines():
                    ev = _ndjson_line(line)
                    if ev is not None:
                        result = reader.feed(ev)
                        if result is not None:
                            return result
        except httpx.TransportError as e:
            raise _unavailable(self.url, e) from e
        raise reader.ended()


_shared: Dict[str, Client] = {}
_shared_async: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[str, AsyncClient]]" = \
    weakref.WeakKeyDictionary()


def shared_client(url: Optional[str] = None) -> Client:
    """One pooled client per daemon URL."""
    key = url or default_url()
    c = _shared.get(key)
    if c is None:
        c = _shared[key] = Client(key)
    return c


def shared_async_client(url: Optional[str] = None) -> AsyncClient:
    """One pooled async client per daemon URL and running event loop."""
    key = url or default_url()
    per_loop = _shared_async.setdefault(asyncio.get_running_loop(), {})
    c = per_loop.get(key)
    if c is None:
        c = per_loop[key] = AsyncClient(key)
    return c
