"""The HTTP connection to forkboxd: where it is, and error translation."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, Optional

import httpx

from .exceptions import DaemonUnavailableError, from_response

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


class Client:
    """A connection pool to one daemon (`unix:///path` or `http://host:port`)."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 600.0) -> None:
        self.url = url or default_url()
        token = token if token is not None else os.environ.get("FORKBOX_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if self.url.startswith("unix://"):
            transport = httpx.HTTPTransport(uds=self.url[len("unix://"):])
            base = "http://forkboxd"
        elif self.url.startswith(("http://", "https://")):
            transport = httpx.HTTPTransport()
            base = self.url.rstrip("/")
        else:
            raise ValueError(f"FORKBOX_URL {self.url!r}: expected unix:///path or http://host:port")
        self._http = httpx.Client(base_url=base, transport=transport, headers=headers,
                                  timeout=httpx.Timeout(timeout, connect=10.0))

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise DaemonUnavailableError(f"cannot reach forkboxd at {self.url}: {e}",
                                         "infrastructure") from e
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = r.text
            raise from_response(r.status_code, body)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        r = self.request(method, path, **kw)
        return r.json() if r.content else None

    def stream_ndjson(self, method: str, path: str, **kw: Any) -> Iterator[Dict[str, Any]]:
        headers = dict(kw.pop("headers", {}))
        headers["Accept"] = "application/x-ndjson"
        try:
            with self._http.stream(method, path, headers=headers, **kw) as r:
                if r.status_code >= 400:
                    r.read()
                    try:
                        body = r.json()
                    except ValueError:
                        body = r.text
                    raise from_response(r.status_code, body)
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.TransportError as e:
            raise DaemonUnavailableError(f"cannot reach forkboxd at {self.url}: {e}",
                                         "infrastructure") from e


_shared: Dict[str, Client] = {}


def shared_client(url: Optional[str] = None) -> Client:
    """One pooled client per daemon URL."""
    key = url or default_url()
    c = _shared.get(key)
    if c is None:
        c = _shared[key] = Client(key)
    return c
