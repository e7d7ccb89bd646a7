"""`AsyncSandbox`: `Sandbox` for asyncio, over the same `_api` calls.

    async with await AsyncSandbox.create("minimal") as sb:
        print((await sb.commands.run("echo hi")).stdout)
"""

from __future__ import annotations

from typing import (Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, TypeVar,
                    Union, overload)

from . import _api, _tar
from ._api import Call
from ._client import AsyncClient, shared_async_client
from .exceptions import ForkboxError, NotFoundError
from .models import (CommandResult, EntryInfo, IntegrityReport, ProcessInfo, ProcessOutput,
                     TemplateInfo)
from .sandbox import SandboxBase

T = TypeVar("T")


async def _do(client: AsyncClient, call: "Call[T]") -> T:
    send = client.download if call.download else client.request
    return call.parse(await send(call.method, call.path, **call.kwargs))


class AsyncCommandHandle:
    """As `CommandHandle`, for asyncio."""

    def __init__(self, sb: "AsyncSandbox", pid: int) -> None:
        self._sb = sb
        self.pid = pid

    async def _do(self, call: "Call[T]") -> T:
        return await _do(self._sb._client, call)

    async def wait(self, timeout: Optional[float] = None,
                   on_stdout: Optional[Callable[[str], None]] = None,
                   on_stderr: Optional[Callable[[str], None]] = None) -> CommandResult:
        """As `CommandHandle.wait`."""
        sid = self._sb.sandbox_id
        if on_stdout is None and on_stderr is None:
            return await self._do(_api.wait_process(sid, self.pid, timeout))
        stream = _api.CommandStream(on_stdout, on_stderr)
        return await self._sb._client.follow_ndjson(
            "GET", _api.follow_output_path(sid, self.pid), stream, **_api.FOLLOW)

    async def kill(self, signal: int = 9) -> bool:
        try:
            return await self._do(_api.kill_process(self._sb.sandbox_id, self.pid, signal))
        except ForkboxError as e:
            if _api.kill_process_refused(e):
                return False
            raise

    async def send_stdin(self, data: Union[str, bytes], close: bool = False) -> int:
        return await self._do(_api.process_stdin(self._sb.sandbox_id, self.pid, data, close))

    async def close_stdin(self) -> None:
        await self.send_stdin(b"", close=True)

    async def output(self) -> ProcessOutput:
        return await self._do(_api.process_output(self._sb.sandbox_id, self.pid))

    def __repr__(self) -> str:
        return f"AsyncCommandHandle(pid={self.pid}, sandbox={self._sb.sandbox_id!r})"


class AsyncCommands:
    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    @overload
    async def run(self, cmd: Union[str, Sequence[str]], *, cwd: Optional[str] = ...,
                  envs: Optional[Mapping[str, str]] = ...,
                  user: Optional[Union[str, int]] = ..., timeout: Optional[float] = ...,
                  stdin: Optional[str] = ...,
                  on_stdout: Optional[Callable[[str], None]] = ...,
                  on_stderr: Optional[Callable[[str], None]] = ...,
                  background: Literal[False] = ...) -> CommandResult: ...

    @overload
    async def run(self, cmd: Union[str, Sequence[str]], *, cwd: Optional[str] = ...,
                  envs: Optional[Mapping[str, str]] = ...,
                  user: Optional[Union[str, int]] = ..., timeout: Optional[float] = ...,
                  stdin: Optional[str] = ...,
                  on_stdout: Optional[Callable[[str], None]] = ...,
                  on_stderr: Optional[Callable[[str], None]] = ...,
                  background: Literal[True]) -> AsyncCommandHandle: ...

    async def run(self, cmd: Union[str, Sequence[str]], *, cwd: Optional[str] = None,
                  envs: Optional[Mapping[str, str]] = None,
                  user: Optional[Union[str, int]] = None, timeout: Optional[float] = None,
                  stdin: Optional[str] = None,
                  on_stdout: Optional[Callable[[str], None]] = None,
                  on_stderr: Optional[Callable[[str], None]] = None,
                  background: bool = False) -> Union[CommandResult, AsyncCommandHandle]:
        """As `Sandbox.commands.run`."""
        body = _api.exec_body(cmd, cwd, envs, user, timeout, stdin)
        sid = self._sb.sandbox_id
        if background:
            pid = await _do(self._sb._client, _api.run_background(sid, body))
            return AsyncCommandHandle(self._sb, pid)
        if on_stdout is None and on_stderr is None:
            return await _do(self._sb._client, _api.run(sid, body))
        stream = _api.CommandStream(on_stdout, on_stderr)
        return await self._sb._client.follow_ndjson("POST", _api.run_stream_path(sid),
                                                      stream, json=body)

    async def list(self) -> List[ProcessInfo]:
        return await _do(self._sb._client, _api.list_processes(self._sb.sandbox_id))

    async def connect(self, pid: int) -> AsyncCommandHandle:
        if not any(p.pid == pid and p.background for p in await self.list()):
            raise NotFoundError(f"no background process {pid}", "not_found", 404)
        return AsyncCommandHandle(self._sb, pid)

    async def kill(self, pid: int, signal: int = 9) -> bool:
        return await AsyncCommandHandle(self._sb, pid).kill(signal)

    async def send_stdin(self, pid: int, data: Union[str, bytes], close: bool = False) -> int:
        return await AsyncCommandHandle(self._sb, pid).send_stdin(data, close)


class AsyncFiles:
    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def _do(self, call: "Call[T]") -> T:
        return await _do(self._sb._client, call)

    async def read(self, path: str, format: str = "text",
                   max_bytes: Optional[int] = None, user: Optional[Union[str, int]] = None) -> Union[str, bytes]:
        return await self._do(_api.read_file(self._sb.sandbox_id, path, format, max_bytes, user))

    async def write(self, path: str, data: Union[str, bytes], mode: int = 0o644,
                    user: Optional[Union[str, int]] = None) -> int:
        return await self._do(_api.write_file(self._sb.sandbox_id, path, data, mode, user))

    async def list(self, path: str, user: Optional[Union[str, int]] = None) -> List[EntryInfo]:
        return await self._do(_api.list_dir(self._sb.sandbox_id, path, user))

    async def stat(self, path: str, user: Optional[Union[str, int]] = None) -> Dict[str, Any]:
        return await self._do(_api.stat(self._sb.sandbox_id, path, user))

    async def exists(self, path: str, user: Optional[Union[str, int]] = None) -> bool:
        try:
            await self.stat(path, user)
            return True
        except NotFoundError:
            return False

    async def remove(self, path: str, recursive: bool = True,
                     user: Optional[Union[str, int]] = None) -> None:
        await self._do(_api.remove(self._sb.sandbox_id, path, recursive, user))

    async def make_dir(self, path: str, user: Optional[Union[str, int]] = None) -> None:
        await self._do(_api.make_dir(self._sb.sandbox_id, path, user))

    async def upload_tar(self, path: str, tar_bytes: bytes, user: Optional[Union[str, int]] = None) -> int:
        return await self._do(_api.upload_tar(self._sb.sandbox_id, path, tar_bytes, user))

    async def download_tar(self, path: str, max_bytes: Optional[int] = None,
                           user: Optional[Union[str, int]] = None) -> bytes:
        return await self._do(_api.download_tar(self._sb.sandbox_id, path, max_bytes, user))

    async def upload_dir(self, local_dir: str, path: str, user: Optional[Union[str, int]] = None) -> int:
        return await self.upload_tar(path, _tar.pack_dir(local_dir), user)

    async def download_dir(self, path: str, local_dir: str,
                           max_bytes: Optional[int] = None, user: Optional[Union[str, int]] = None) -> None:
        _tar.unpack_to(await self.download_tar(path, max_bytes, user), local_dir)


class AsyncNetwork:
    """As `Network` (`sb.network`), for asyncio."""

    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def _do(self, call: "Call[T]") -> T:
        return await _do(self._sb._client, call)

    async def get(self) -> Dict[str, Any]:
        return await self._do(_api.get_network(self._sb.sandbox_id))

    async def update(self, network: Optional[_api.NetworkArg] = None, *,
                     allow_out: Optional[Sequence[str]] = None,
                     deny_out: Optional[Sequence[str]] = None) -> Dict[str, Any]:
        """As `Network.update`: replaces the whole policy."""
        policy = _api.network_policy(network, allow_out=allow_out, deny_out=deny_out)
        return await self._do(_api.set_network(self._sb.sandbox_id, policy))

    async def egress_log(self, limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """As `Network.egress_log`."""
        return await self._do(_api.egress_log(self._sb.sandbox_id, limit))


class AsyncIntegrity:
    """As `Integrity` (`sb.integrity`), for asyncio."""

    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def check(self) -> IntegrityReport:
        """As `Integrity.check`."""
        return await _do(self._sb._client, _api.integrity(self._sb.sandbox_id))


class AsyncSandbox(SandboxBase):
    """A sandbox on forkboxd, for asyncio. `async with` kills it on exit."""

    def __init__(self, info: Dict[str, Any], client: AsyncClient) -> None:
        super().__init__(info)
        self._client = client
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.network = AsyncNetwork(self)
        self.integrity = AsyncIntegrity(self)

    @classmethod
    async def create(cls, template: str = "minimal", *, timeout: Optional[float] = 300,
                     metadata: Optional[Mapping[str, str]] = None,
                     envs: Optional[Mapping[str, str]] = None, on_timeout: str = "kill",
                     wait: Optional[float] = None,
                     network: Optional[_api.NetworkArg] = None,
                     seed: Optional[int] = None,
                     limits: Optional[_api.LimitsArg] = None,
                     url: Optional[str] = None) -> "AsyncSandbox":
        """As `Sandbox.create`."""
        c = shared_async_client(url)
        return cls(await _do(c, _api.create(template, timeout, on_timeout, metadata, envs,
                                            wait, network, seed, limits)), c)

    @classmethod
    async def connect(cls, sandbox_id: str, url: Optional[str] = None) -> "AsyncSandbox":
        c = shared_async_client(url)
        return cls(await _do(c, _api.info(sandbox_id)), c)

    @classmethod
    async def list(cls, metadata: Optional[Mapping[str, str]] = None,
                   url: Optional[str] = None) -> List["AsyncSandbox"]:
        c = shared_async_client(url)
        return [cls(i, c) for i in await _do(c, _api.list_sandboxes(metadata))]

    @classmethod
    async def kill_by_metadata(cls, metadata: Mapping[str, str],
                               url: Optional[str] = None) -> List[str]:
        return await _do(shared_async_client(url), _api.kill_by_metadata(metadata))

    async def get_info(self) -> Dict[str, Any]:
        self._info = await _do(self._client, _api.info(self.sandbox_id))
        return dict(self._info)

    async def is_running(self) -> bool:
        try:
            return bool((await self.get_info())["state"] == "running")
        except NotFoundError:
            return False

    async def kill(self) -> bool:
        """Kills the sandbox; False if it was already dead or unknown."""
        try:
            return await _do(self._client, _api.kill(self.sandbox_id))
        except ForkboxError as e:
            if _api.kill_refused(e):
                return False
            raise

    async def set_timeout(self, timeout: Optional[float],
                          on_timeout: Optional[str] = None) -> None:
        self._info = await _do(self._client,
                               _api.set_timeout(self.sandbox_id, timeout, on_timeout))

    async def pause(self) -> None:
        self._info = await _do(self._client, _api.pause(self.sandbox_id))

    async def resume(self) -> None:
        self._info = await _do(self._client, _api.resume(self.sandbox_id))

    async def fork(self, count: int = 1, seed: Optional[int] = None, *,
                   on_child: Optional[Callable[[int, Union["AsyncSandbox", ForkboxError]],
                                               None]] = None
                   ) -> List[Union["AsyncSandbox", ForkboxError]]:
        """As `Sandbox.fork`: children or per-child errors, in order;
        `on_child(i, child)` (a plain function, called on the event loop:
        it may start tasks) gets each child as soon as it is up."""
        call = _api.fork(self.sandbox_id, count, seed)
        if on_child is None:
            entries = await _do(self._client, call)
            return [self._child(e) for e in entries]
        return await self._client.follow_ndjson(call.method, call.path,
                                                _api.ForkStream(count, self._child, on_child),
                                                **call.kwargs)

    def _child(self, entry: _api.ForkEntry) -> Union["AsyncSandbox", ForkboxError]:
        return entry if isinstance(entry, ForkboxError) else AsyncSandbox(entry, self._client)

    async def create_snapshot(self, name: str) -> TemplateInfo:
        return await _do(self._client, _api.snapshot(self.sandbox_id, name))

    async def get_host(self, port: int, *, wait: Optional[float] = None) -> str:
        """As `Sandbox.get_host`."""
        return await _do(self._client, _api.open_port(self.sandbox_id, port, wait))

    async def ports(self) -> Dict[int, str]:
        return await _do(self._client, _api.list_ports(self.sandbox_id))

    async def close_port(self, port: int) -> None:
        await _do(self._client, _api.close_port(self.sandbox_id, port))

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.kill()
