"""`Sandbox`: one microVM, in E2B's spelling where it exists (blocking;
`AsyncSandbox` is the asyncio twin over the same `_api` calls)."""

from __future__ import annotations

from typing import (Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, TypeVar,
                    Union, overload)

from . import _api, _tar
from ._api import Call
from ._client import Client, shared_client
from .exceptions import ForkboxError, NotFoundError, UnsupportedError
from .models import (CommandResult, EntryInfo, IntegrityReport, ProcessInfo, ProcessOutput,
                     TemplateInfo)

T = TypeVar("T")


def _do(client: Client, call: "Call[T]") -> T:
    send = client.download if call.download else client.request
    return call.parse(send(call.method, call.path, **call.kwargs))


class CommandHandle:
    """A background process (`commands.run(..., background=True)` or
    `commands.connect(pid)`). It runs on whether or not this handle is
    kept."""

    def __init__(self, sb: "Sandbox", pid: int) -> None:
        self._sb = sb
        self.pid = pid

    def _do(self, call: "Call[T]") -> T:
        return _do(self._sb._client, call)

    def wait(self, timeout: Optional[float] = None,
             on_stdout: Optional[Callable[[str], None]] = None,
             on_stderr: Optional[Callable[[str], None]] = None) -> CommandResult:
        """Waits for it to end; its result with the output the guest kept
        (the last 1 MiB). A non-zero exit is a result, not an exception.
        Still running after `timeout` seconds: `ProcessTimeoutError` (it
        runs on). With `on_stdout`/`on_stderr`: its output so far, then as
        it comes, goes to them (and `timeout` is not applied)."""
        sid = self._sb.sandbox_id
        if on_stdout is None and on_stderr is None:
            return self._do(_api.wait_process(sid, self.pid, timeout))
        stream = _api.CommandStream(on_stdout, on_stderr)
        return self._sb._client.follow_ndjson("GET", _api.follow_output_path(sid, self.pid),
                                                stream, **_api.FOLLOW)

    def kill(self, signal: int = 9) -> bool:
        """Signals its process group (default SIGKILL); False if it had
        already ended."""
        try:
            return self._do(_api.kill_process(self._sb.sandbox_id, self.pid, signal))
        except ForkboxError as e:
            if _api.kill_process_refused(e):
                return False
            raise

    def send_stdin(self, data: Union[str, bytes], close: bool = False) -> int:
        """Writes to its stdin (`close`: then close it, so it sees EOF);
        returns the bytes written."""
        return self._do(_api.process_stdin(self._sb.sandbox_id, self.pid, data, close))

    def close_stdin(self) -> None:
        self.send_stdin(b"", close=True)

    def output(self) -> ProcessOutput:
        """What it wrote so far, and its result if it ended."""
        return self._do(_api.process_output(self._sb.sandbox_id, self.pid))

    def __repr__(self) -> str:
        return f"CommandHandle(pid={self.pid}, sandbox={self._sb.sandbox_id!r})"


class Commands:
    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    @overload
    def run(self, cmd: Union[str, Sequence[str]], *, cwd: Optional[str] = ...,
            envs: Optional[Mapping[str, str]] = ..., user: Optional[Union[str, int]] = ...,
            timeout: Optional[float] = ..., stdin: Optional[str] = ...,
            on_stdout: Optional[Callable[[str], None]] = ...,
            on_stderr: Optional[Callable[[str], None]] = ...,
            background: Literal[False] = ...) -> CommandResult: ...

    @overload
    def run(self, cmd: Union[str, Sequence[str]], *, cwd: Optional[str] = ...,
            envs: Optional[Mapping[str, str]] = ..., user: Optional[Union[str, int]] = ...,
            timeout: Optional[float] = ..., stdin: Optional[str] = ...,
            on_stdout: Optional[Callable[[str], None]] = ...,
            on_stderr: Optional[Callable[[str], None]] = ...,
            background: Literal[True]) -> CommandHandle: ...

    def run(self, cmd: Union[str, Sequence[str]], *, cwd: Optional[str] = None,
            envs: Optional[Mapping[str, str]] = None, user: Optional[Union[str, int]] = None,
            timeout: Optional[float] = None, stdin: Optional[str] = None,
            on_stdout: Optional[Callable[[str], None]] = None,
            on_stderr: Optional[Callable[[str], None]] = None,
            background: bool = False) -> Union[CommandResult, CommandHandle]:
        """Runs `cmd` (a shell string, or an argv list) and waits for it,
        as `user` (a name or uid; default `user`, the image's unprivileged
        user: ask for `"root"` when a command needs it).
        A non-zero exit is a result, not an exception; infrastructure
        failures raise `InfrastructureError`. With `on_stdout`/`on_stderr`,
        output is streamed to them as it is produced.

        With `background=True` it returns a `CommandHandle` at once (the
        callbacks are not used: pass them to `handle.wait`); the process's
        stdin (after `stdin`) stays open for `handle.send_stdin`."""
        body = _api.exec_body(cmd, cwd, envs, user, timeout, stdin)
        sid = self._sb.sandbox_id
        if background:
            return CommandHandle(self._sb, _do(self._sb._client, _api.run_background(sid, body)))
        if on_stdout is None and on_stderr is None:
            return _do(self._sb._client, _api.run(sid, body))
        stream = _api.CommandStream(on_stdout, on_stderr)
        return self._sb._client.follow_ndjson("POST", _api.run_stream_path(sid), stream,
                                                json=body)

    def list(self) -> List[ProcessInfo]:
        """Background processes (running, and the last 64 that ended) and
        commands running with a client."""
        return _do(self._sb._client, _api.list_processes(self._sb.sandbox_id))

    def connect(self, pid: int) -> CommandHandle:
        """A handle on background process `pid` (checks that it exists)."""
        if not any(p.pid == pid and p.background for p in self.list()):
            raise NotFoundError(f"no background process {pid}", "not_found", 404)
        return CommandHandle(self._sb, pid)

    def kill(self, pid: int, signal: int = 9) -> bool:
        return CommandHandle(self._sb, pid).kill(signal)

    def send_stdin(self, pid: int, data: Union[str, bytes], close: bool = False) -> int:
        return CommandHandle(self._sb, pid).send_stdin(data, close)


class Files:
    """A sandbox's files (`sb.files`). Every call acts with a guest user's
    rights: `user=` (a name or uid), by default `user`, the image's
    unprivileged user; `user="root"` must be asked for. The guest's kernel
    checks each path as that user's, so a link to a file the user may not
    read is refused (`ForkboxError`, HTTP 403), not followed as root, and
    what the user writes is theirs."""

    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def _do(self, call: "Call[T]") -> T:
        return _do(self._sb._client, call)

    def read(self, path: str, format: str = "text",
             max_bytes: Optional[int] = None, user: Optional[Union[str, int]] = None) -> Union[str, bytes]:
        """The file's text (`format="text"`, UTF-8) or bytes (`"bytes"`).
        Over `max_bytes` (default: the daemon's, 256 MiB): `TooLargeError`.
        A guest that does not finish in time: `GuestTimeoutError`."""
        return self._do(_api.read_file(self._sb.sandbox_id, path, format, max_bytes, user))

    def write(self, path: str, data: Union[str, bytes], mode: int = 0o644,
              user: Optional[Union[str, int]] = None) -> int:
        """Writes a file, creating its parent directories; returns its size."""
        return self._do(_api.write_file(self._sb.sandbox_id, path, data, mode, user))

    def list(self, path: str, user: Optional[Union[str, int]] = None) -> List[EntryInfo]:
        return self._do(_api.list_dir(self._sb.sandbox_id, path, user))

    def stat(self, path: str, user: Optional[Union[str, int]] = None) -> Dict[str, Any]:
        return self._do(_api.stat(self._sb.sandbox_id, path, user))

    def exists(self, path: str, user: Optional[Union[str, int]] = None) -> bool:
        try:
            self.stat(path, user)
            return True
        except NotFoundError:
            return False

    def remove(self, path: str, recursive: bool = True,
               user: Optional[Union[str, int]] = None) -> None:
        self._do(_api.remove(self._sb.sandbox_id, path, recursive, user))

    def make_dir(self, path: str, user: Optional[Union[str, int]] = None) -> None:
        self._do(_api.make_dir(self._sb.sandbox_id, path, user))

    def upload_tar(self, path: str, tar_bytes: bytes, user: Optional[Union[str, int]] = None) -> int:
        return self._do(_api.upload_tar(self._sb.sandbox_id, path, tar_bytes, user))

    def download_tar(self, path: str, max_bytes: Optional[int] = None,
                     user: Optional[Union[str, int]] = None) -> bytes:
        """The guest directory as a tar archive; over `max_bytes`
        (default 256 MiB): `TooLargeError`."""
        return self._do(_api.download_tar(self._sb.sandbox_id, path, max_bytes, user))

    def upload_dir(self, local_dir: str, path: str, user: Optional[Union[str, int]] = None) -> int:
        """Copies the contents of `local_dir` into the guest directory
        `path` (created if missing) as one tar stream; returns its bytes."""
        return self.upload_tar(path, _tar.pack_dir(local_dir), user)

    def download_dir(self, path: str, local_dir: str, max_bytes: Optional[int] = None,
                     user: Optional[Union[str, int]] = None) -> None:
        """Copies the guest directory `path` into `local_dir` (created if
        missing) as one tar stream (at most `max_bytes` of it). A member
        that would land outside `local_dir`, a link leading out, a device or
        a FIFO stops it with `UnsafeArchiveError` naming the member; setuid,
        setgid and sticky bits are dropped."""
        _tar.unpack_to(self.download_tar(path, max_bytes, user), local_dir)


class Network:
    """A sandbox's egress policy and log (`sb.network`). A new sandbox
    reaches nothing outside itself unless its policy allows; a fork
    starts with its parent's policy.

    A rule is a DNS name (`pypi.org`), a suffix (`*.debian.org`: names
    strictly below it), an address or CIDR (`10.1.0.0/16`,
    `[2001:db8::/32]:443`) or `*`, each with an optional `:port`, port
    range (`:8000-8999`) or `:*`. `host.forkbox.internal[:port]` is the
    host's own loopback, reached only by a rule naming it. Deny rules win
    over allow rules."""

    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def _do(self, call: "Call[T]") -> T:
        return _do(self._sb._client, call)

    def get(self) -> Dict[str, Any]:
        """The policy now, rules in normal form: `{"allow_out": [...],
        "deny_out": [...], "active": True}`. `active` is False only for a
        sandbox re-adopted after a daemon restart: it opens no new
        connection, whatever the policy says."""
        return self._do(_api.get_network(self._sb.sandbox_id))

    def update(self, network: Optional[_api.NetworkArg] = None, *,
               allow_out: Optional[Sequence[str]] = None,
               deny_out: Optional[Sequence[str]] = None) -> Dict[str, Any]:
        """Replaces the whole policy (a list not given is empty: `update()`
        denies everything) and answers the new one, as `get`. New
        connections and DNS lookups follow it at once; open connections
        are left alone. Takes a dict like `get`'s answer (its `active` is
        ignored), or the lists as keywords (which win over the dict's). A
        bad rule raises `InvalidRequestError` naming it; the policy is then
        unchanged."""
        policy = _api.network_policy(network, allow_out=allow_out, deny_out=deny_out)
        return self._do(_api.set_network(self._sb.sandbox_id, policy))

    def egress_log(self, limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """What the sandbox tried to reach, oldest first: the last `limit`
        records (default 1000, the daemon's). Each record is a dict:
        `time_ms` (since the epoch), `sandbox`, `protocol` (`tcp`, `dns`
        or `udp`), `name` (the DNS name asked, or looked up for the
        address), `address`, `port`, `verdict` (`allow` or `deny`),
        `reason` (`rule`, `no_rule`, `special_address`, `connect_failed`,
        …), `rule` (the rule that decided), `answers` (a DNS answer's
        addresses), `bytes_out`, `bytes_in`, `duration_ms`, `error`; the
        optional ones are absent when empty. Readable after the sandbox
        is killed, until the daemon's log TTL."""
        return self._do(_api.egress_log(self._sb.sandbox_id, limit))


class Integrity:
    """A sandbox's protected paths (`sb.integrity`): its template's
    `protect`, recorded when the template was baked."""

    def __init__(self, sb: "Sandbox") -> None:
        self._sb = sb

    def check(self) -> IntegrityReport:
        """Compares the protected paths with the bake's record: which
        changed (content, type, owner, permissions), were added under a
        protected path, or are gone. The report is truthy when nothing
        did; a fork is compared with its template's record, never with
        its parent's state. Check before grading."""
        return _do(self._sb._client, _api.integrity(self._sb.sandbox_id))


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
        self.network = Network(self)
        self.integrity = Integrity(self)

    # -- creation and lookup

    @classmethod
    def create(cls, template: str = "minimal", *, timeout: Optional[float] = 300,
               metadata: Optional[Mapping[str, str]] = None,
               envs: Optional[Mapping[str, str]] = None, on_timeout: str = "kill",
               wait: Optional[float] = None, network: Optional[_api.NetworkArg] = None,
               seed: Optional[int] = None, limits: Optional[_api.LimitsArg] = None,
               url: Optional[str] = None) -> "Sandbox":
        """Creates a sandbox from `template` (a fork of its zygote; the first
        create of a template not baked yet bakes it, which takes a while)
        and waits until it is ready. `timeout`: its time-to-live in seconds
        (`None`: until killed); `on_timeout`: `kill` or `pause`.
        `network`: its egress policy, `{"allow_out": [rule, …],
        "deny_out": [rule, …]}` (see `Network`); without it the sandbox
        reaches nothing outside itself (a template's bake-time policy is
        not inherited). A bad rule raises `InvalidRequestError`.
        `seed` (0 to 2**64 - 1): as `fork`'s, the sandbox being child 0.
        `limits`: the host resources it may take, over its template's:
        `{"cpus": 0.5, "memory_mib": 256}` (CPU time in CPUs, up to its
        vCPUs + 1; host memory of its own in MiB, what its guest writes
        plus its VMM's, 32 up to its RAM + 512, past which the host ends
        it). More than its shape gets raises `InvalidRequestError`.
        `info()["metrics"]["limits"]` shows what holds (`None` where the
        host gives sandboxes no cgroup)."""
        c = shared_client(url)
        return cls(_do(c, _api.create(template, timeout, on_timeout, metadata, envs, wait,
                                      network, seed, limits)), c)

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

    def fork(self, count: int = 1, seed: Optional[int] = None, *,
             on_child: Optional[Callable[[int, Union["Sandbox", ForkboxError]], None]] = None
             ) -> List[Union["Sandbox", ForkboxError]]:
        """Forks into `count` (1-1024) children that start from this
        sandbox's current memory and files. One entry per child, in order:
        the child, or the error that child met (an exception instance,
        not raised: the others are fine). The caller kills the children.

        `on_child(i, child)`: called (on this thread) with each child as
        soon as it is up, in the order they come up, before this returns:
        start work on the first children of a wide group while the last
        are still coming. Should the stream break, this raises an
        `InfrastructureError`; the children already given exist.

        `seed` (0 to 2**64 - 1): child `i`'s randomness derives from
        (`seed`, `i`): the entropy its kernel RNG is given after the fork,
        and `FORKBOX_SEED` in its commands' environment (and
        `/run/forkbox/seed`). The kernel RNG also mixes in the CPU's and
        interrupts' randomness, so `/dev/urandom` does not repeat; code
        that wants to repeat seeds its own generator from `FORKBOX_SEED`.
        Without a seed: fresh host entropy, no `FORKBOX_SEED`."""
        call = _api.fork(self.sandbox_id, count, seed)
        if on_child is None:
            entries = _do(self._client, call)
            return [self._child(e) for e in entries]
        return self._client.follow_ndjson(call.method, call.path,
                                          _api.ForkStream(count, self._child, on_child),
                                          **call.kwargs)

    def _child(self, entry: _api.ForkEntry) -> Union["Sandbox", ForkboxError]:
        return entry if isinstance(entry, ForkboxError) else Sandbox(entry, self._client)

    def create_snapshot(self, name: str) -> TemplateInfo:
        """Makes a template `name` from this sandbox's current state:
        sandboxes created from it fork that state. This one keeps running."""
        return _do(self._client, _api.snapshot(self.sandbox_id, name))

    def get_host(self, port: int, *, wait: Optional[float] = None) -> str:
        """`127.0.0.2:NNNNN`: a host address whose connections reach guest
        TCP `port` (on the guest's loopback) through the daemon; opens the
        forward if needed. The guest port must accept: a refusing one
        raises `ConflictError` (`detail["guest_kind"]` is
        `connection_refused`), after retrying for `wait` seconds if given
        (a server still starting).
        The forward closes when the sandbox dies, or with `close_port`."""
        return _do(self._client, _api.open_port(self.sandbox_id, port, wait))

    def ports(self) -> Dict[int, str]:
        """Open forwards: guest port → host address."""
        return _do(self._client, _api.list_ports(self.sandbox_id))

    def close_port(self, port: int) -> None:
        _do(self._client, _api.close_port(self.sandbox_id, port))

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


__all__ = ["Sandbox", "CommandHandle", "Network", "CommandResult", "EntryInfo",
           "UnsupportedError"]
