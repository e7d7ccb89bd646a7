"""`Sandbox`: one microVM, in E2B's spelling where it exists (blocking;
`AsyncSandbox` is the asyncio twin over the same `_api` calls)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TypeVar, Union

from . import _api
from ._api import Call
from ._client import Client, shared_client
from .exceptions import ForkboxError, NotFoundError, UnsupportedError
from .models import CommandResult, EntryInfo, TemplateInfo

T = TypeVar("T")


def _do(client: Client, call: "Call[T]") -> T:
    return call.parse(client.request(call.method, call.path, **call.kwargs))


class Commands:
    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def run(self, cmd: Union[str, Sequence[str]], *, cwd: Optional[str] = None,
            envs: Optional[Mapping[str, str]] = None, user: Optional[Union[str, int]] = None,
            timeout: Optional[float] = None, stdin: Optional[str] = None,
            on_stdout: Optional[Callable[[str], None]] = None,
            on_stderr: Optional[Callable[[str], None]] = None) -> CommandResult:
        """Runs `cmd` (a shell string, or an argv list) and waits for it.
        A non-zero exit is a result, not an exception; infrastructure
        failures raise `InfrastructureError`. With `on_stdout`/`on_stderr`,
        output is streamed to them as it is produced."""
        body = _api.exec_body(cmd, cwd, envs, user, timeout, stdin)
        sid = self._sb.sandbox_id
        if on_stdout is None and on_stderr is None:
            return _do(self._sb._client, _api.run(sid, body))
        stream = _api.CommandStream(on_stdout, on_stderr)
        for ev in self._sb._client.stream_ndjson("POST", _api.run_stream_path(sid), json=body):
            result = stream.feed(ev)
            if result is not None:
                return result
        raise stream.ended()


class Files:
    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def _do(self, call: "Call[T]") -> T:
        return _do(self._sb._client, call)

    def read(self, path: str, format: str = "text") -> Union[str, bytes]:
        """The file's text (`format="text"`, UTF-8) or bytes (`"bytes"`)."""
        return self._do(_api.read_file(self._sb.sandbox_id, path, format))

    def write(self, path: str, data: Union[str, bytes], mode: int = 0o644) -> int:
        """Writes a file, creating its parent directories; returns its size."""
        return self._do(_api.write_file(self._sb.sandbox_id, path, data, mode))

    def list(self, path: str) -> List[EntryInfo]:
        return self._do(_api.list_dir(self._sb.sandbox_id, path))

    def stat(self, path: str) -> Dict[str, Any]:
        return self._do(_api.stat(self._sb.sandbox_id, path))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except NotFoundError:
            return False

    def remove(self, path: str, recursive: bool = True) -> None:
        self._do(_api.remove(self._sb.sandbox_id, path, recursive))

    def make_dir(self, path: str) -> None:
        self._do(_api.make_dir(self._sb.sandbox_id, path))

    def upload_tar(self, path: str, tar_bytes: bytes) -> int:
        return self._do(_api.upload_tar(self._sb.sandbox_id, path, tar_bytes))

    def download_tar(self, path: str) -> bytes:
        return self._do(_api.download_tar(self._sb.sandbox_id, path))


class SandboxBase:
    """What the blocking and async sandboxes share: identity and the last
    info the daemon gave."""

    def __init__(self, info: Dict[str, Any]) -> None:
        self._info = info
        self.sandbox_id: str = info["id"]

    @property
    def metadata(self) -> Dict[str, str]:
        return dict(self._info.get("metadata", {}))

    @property
    def template(self) -> str:
        return str(self._info.get("template"))

    @property
    def info(self) -> Dict[str, Any]:
        """The info the daemon last answered (refresh with `get_info()`)."""
        return dict(self._info)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sandbox_id!r}, template={self.template!r})"


class Sandbox(SandboxBase):
    """A sandbox on forkboxd. Use as a context manager to kill it on exit,
    even on error."""

    def __init__(self, info: Dict[str, Any], client: Client) -> None:
        super().__init__(info)
        self._client = client
        self.commands = Commands(self)
        self.files = Files(self)

    # -- creation and lookup

    @classmethod
    def create(cls, template: str = "minimal", *, timeout: Optional[float] = 300,
               metadata: Optional[Mapping[str, str]] = None,
               envs: Optional[Mapping[str, str]] = None, on_timeout: str = "kill",
               wait: Optional[float] = None, url: Optional[str] = None) -> "Sandbox":
        """Creates a sandbox from `template` (a fork of its zygote; the first
        create of a template not baked yet bakes it, which takes a while)
        and waits until it is ready. `timeout`: its time-to-live in seconds
        (`None`: until killed); `on_timeout`: `kill` or `pause`."""
        c = shared_client(url)
        return cls(_do(c, _api.create(template, timeout, on_timeout, metadata, envs, wait)), c)

    @classmethod
    def connect(cls, sandbox_id: str, url: Optional[str] = None) -> "Sandbox":
        c = shared_client(url)
        return cls(_do(c, _api.info(sandbox_id)), c)

    @classmethod
    def list(cls, metadata: Optional[Mapping[str, str]] = None,
             url: Optional[str] = None) -> List["Sandbox"]:
        c = shared_client(url)
        return [cls(i, c) for i in _do(c, _api.list_sandboxes(metadata))]

    @classmethod
    def kill_by_metadata(cls, metadata: Mapping[str, str],
                         url: Optional[str] = None) -> List[str]:
        return _do(shared_client(url), _api.kill_by_metadata(metadata))

    # -- this sandbox

    def get_info(self) -> Dict[str, Any]:
        self._info = _do(self._client, _api.info(self.sandbox_id))
        return dict(self._info)

    def is_running(self) -> bool:
        try:
            return bool(self.get_info()["state"] == "running")
        except NotFoundError:
            return False

    def kill(self) -> bool:
        """Kills the sandbox; False if it was already dead or unknown."""
        try:
            return _do(self._client, _api.kill(self.sandbox_id))
        except ForkboxError as e:
            if _api.kill_refused(e):
                return False
            raise

    def set_timeout(self, timeout: Optional[float], on_timeout: Optional[str] = None) -> None:
        """A new time-to-live in seconds, counted from now (`None`: none)."""
        self._info = _do(self._client, _api.set_timeout(self.sandbox_id, timeout, on_timeout))

    def pause(self) -> None:
        """Stops the sandbox's vCPUs; its memory and files stay."""
        self._info = _do(self._client, _api.pause(self.sandbox_id))

    def resume(self) -> None:
        self._info = _do(self._client, _api.resume(self.sandbox_id))

    def fork(self, count: int = 1) -> List[Union["Sandbox", ForkboxError]]:
        """Forks into `count` (1-256) children that start from this
        sandbox's current memory and files. One entry per child, in order:
        the child, or the error that child met (an exception instance,
        not raised: the others are fine). The caller kills the children."""
        entries = _do(self._client, _api.fork(self.sandbox_id, count))
        return [e if isinstance(e, ForkboxError) else Sandbox(e, self._client) for e in entries]

    def create_snapshot(self, name: str) -> TemplateInfo:
        """Makes a template `name` from this sandbox's current state:
        sandboxes created from it fork that state. This one keeps running."""
        return _do(self._client, _api.snapshot(self.sandbox_id, name))

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


__all__ = ["Sandbox", "CommandResult", "EntryInfo", "UnsupportedError"]
