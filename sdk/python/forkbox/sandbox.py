"""`Sandbox`: one microVM, in E2B's spelling where it exists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

from ._client import Client, shared_client
from .exceptions import ForkboxError, InfrastructureError, NotFoundError, UnsupportedError


@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]
    duration: float
    """Seconds, measured by the guest agent."""
    timed_out: bool
    signal: Optional[int] = None


@dataclass
class EntryInfo:
    name: str
    path: str
    type: str
    """`file`, `dir`, `symlink` or `other`."""
    size: int
    mode: int
    mtime: int


def _params(**kw: Any) -> Dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


class Commands:
    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def run(self, cmd: Union[str, List[str]], *, cwd: Optional[str] = None,
            envs: Optional[Dict[str, str]] = None, user: Optional[Union[str, int]] = None,
            timeout: Optional[float] = None, stdin: Optional[str] = None,
            on_stdout: Optional[Callable[[str], None]] = None,
            on_stderr: Optional[Callable[[str], None]] = None) -> CommandResult:
        """Runs `cmd` (a shell string, or an argv list) and waits for it.
        A non-zero exit is a result, not an exception; infrastructure
        failures raise `InfrastructureError`. With `on_stdout`/`on_stderr`,
        output is streamed to them as it is produced."""
        body: Dict[str, Any] = {"envs": envs or {}}
        if isinstance(cmd, str):
            body["cmd"] = cmd
        else:
            body["argv"] = list(cmd)
        if cwd is not None:
            body["cwd"] = cwd
        if user is not None:
            body["user"] = str(user)
        if timeout is not None:
            body["timeout_secs"] = timeout
        if stdin is not None:
            body["stdin"] = stdin
        path = f"/sandboxes/{self._sb.sandbox_id}/commands"
        c = self._sb._client
        if on_stdout is None and on_stderr is None:
            r = c.json("POST", path, json=body)
            return _result(r, r.get("stdout", ""), r.get("stderr", ""))
        out: List[str] = []
        err: List[str] = []
        for ev in c.stream_ndjson("POST", path, json=body):
            t = ev.get("type")
            if t == "stdout":
                out.append(ev["data"])
                if on_stdout:
                    on_stdout(ev["data"])
            elif t == "stderr":
                err.append(ev["data"])
                if on_stderr:
                    on_stderr(ev["data"])
            elif t == "exit":
                return _result(ev, "".join(out), "".join(err))
            elif t == "error":
                from .exceptions import from_response
                raise from_response(502, ev)
        raise InfrastructureError("the command's stream ended without a result", "infrastructure")


def _result(r: Dict[str, Any], stdout: str, stderr: str) -> CommandResult:
    return CommandResult(stdout=stdout, stderr=stderr, exit_code=r.get("exit_code"),
                         duration=float(r.get("duration_ms", 0.0)) / 1000.0,
                         timed_out=bool(r.get("timed_out")), signal=r.get("signal"))


class Files:
    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb
        self._base = f"/sandboxes/{sb.sandbox_id}/files"

    def read(self, path: str, format: str = "text") -> Union[str, bytes]:
        data = self._sb._client.request("GET", self._base, params={"path": path}).content
        return data if format == "bytes" else data.decode("utf-8", errors="replace")

    def write(self, path: str, data: Union[str, bytes], mode: int = 0o644) -> int:
        """Writes a file, creating its parent directories; returns its size."""
        raw = data.encode() if isinstance(data, str) else data
        r = self._sb._client.json("PUT", self._base, params={"path": path, "mode": f"{mode:o}"},
                                  content=raw)
        return int(r["bytes"])

    def list(self, path: str) -> List[EntryInfo]:
        r = self._sb._client.json("GET", self._base + "/list", params={"path": path})
        return [EntryInfo(name=e["name"], path=e["path"], type=e["kind"], size=e["size"],
                          mode=e["mode"], mtime=e["mtime"]) for e in r]

    def stat(self, path: str) -> Dict[str, Any]:
        return self._sb._client.json("GET", self._base + "/stat", params={"path": path})

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except NotFoundError:
            return False

    def remove(self, path: str, recursive: bool = True) -> None:
        self._sb._client.request("DELETE", self._base,
                                 params={"path": path, "recursive": str(recursive).lower()})

    def make_dir(self, path: str) -> None:
        self._sb._client.request("POST", self._base + "/mkdir", params={"path": path})

    def upload_tar(self, path: str, tar_bytes: bytes) -> int:
        r = self._sb._client.json("PUT", self._base + "/tar", params={"path": path},
                                  content=tar_bytes)
        return int(r["bytes"])

    def download_tar(self, path: str) -> bytes:
        return self._sb._client.request("GET", self._base + "/tar", params={"path": path}).content


class Sandbox:
    """A sandbox on forkboxd. Use as a context manager to kill it on exit,
    even on error."""

    def __init__(self, info: Dict[str, Any], client: Client) -> None:
        self._client = client
        self._info = info
        self.sandbox_id: str = info["id"]
        self.commands = Commands(self)
        self.files = Files(self)

    # -- creation and lookup

    @classmethod
    def create(cls, template: str = "minimal", *, timeout: Optional[float] = 300,
               metadata: Optional[Dict[str, str]] = None, envs: Optional[Dict[str, str]] = None,
               on_timeout: str = "kill", wait: Optional[float] = None,
               url: Optional[str] = None) -> "Sandbox":
        """Creates a sandbox from `template` and waits until it is ready.
        `timeout`: its time-to-live in seconds (`None`: until killed)."""
        c = shared_client(url)
        body: Dict[str, Any] = {"template": template, "timeout_secs": timeout,
                                "on_timeout": on_timeout, "metadata": metadata or {},
                                "envs": envs or {}}
        if wait is not None:
            body["wait_secs"] = wait
        return cls(c.json("POST", "/sandboxes", json=body), c)

    @classmethod
    def connect(cls, sandbox_id: str, url: Optional[str] = None) -> "Sandbox":
        c = shared_client(url)
        return cls(c.json("GET", f"/sandboxes/{sandbox_id}"), c)

    @classmethod
    def list(cls, metadata: Optional[Dict[str, str]] = None,
             url: Optional[str] = None) -> List["Sandbox"]:
        c = shared_client(url)
        params = [("label", f"{k}={v}") for k, v in (metadata or {}).items()]
        return [cls(i, c) for i in c.json("GET", "/sandboxes", params=params)]

    @classmethod
    def kill_by_metadata(cls, metadata: Dict[str, str], url: Optional[str] = None) -> List[str]:
        c = shared_client(url)
        return list(c.json("POST", "/sandboxes/kill", json={"metadata": metadata})["killed"])

    # -- this sandbox

    def get_info(self) -> Dict[str, Any]:
        self._info = self._client.json("GET", f"/sandboxes/{self.sandbox_id}")
        return self._info

    @property
    def metadata(self) -> Dict[str, str]:
        return dict(self._info.get("metadata", {}))

    @property
    def template(self) -> str:
        return str(self._info.get("template"))

    def is_running(self) -> bool:
        try:
            return self.get_info()["state"] == "running"
        except NotFoundError:
            return False

    def kill(self) -> bool:
        """Kills the sandbox; False if it was already dead or unknown."""
        try:
            self._client.request("DELETE", f"/sandboxes/{self.sandbox_id}")
            return True
        except ForkboxError as e:
            if e.kind in ("not_found", "conflict"):
                return False
            raise

    def set_timeout(self, timeout: Optional[float], on_timeout: Optional[str] = None) -> None:
        """A new time-to-live in seconds, counted from now (`None`: none)."""
        body: Dict[str, Any] = {"timeout_secs": timeout}
        if on_timeout is not None:
            body["on_timeout"] = on_timeout
        self._info = self._client.json("POST", f"/sandboxes/{self.sandbox_id}/timeout", json=body)

    def pause(self) -> None:
        self._info = self._client.json("POST", f"/sandboxes/{self.sandbox_id}/pause")

    def resume(self) -> None:
        self._info = self._client.json("POST", f"/sandboxes/{self.sandbox_id}/resume")

    def fork(self, count: int = 1) -> List[Union["Sandbox", Exception]]:
        """Forks into `count` children. Raises `UnsupportedError` until the
        daemon's fork lands."""
        r = self._client.json("POST", f"/sandboxes/{self.sandbox_id}/fork", json={"count": count})
        return [Sandbox(i, self._client) for i in r]

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r}, template={self.template!r})"


__all__ = ["Sandbox", "CommandResult", "EntryInfo", "UnsupportedError"]
