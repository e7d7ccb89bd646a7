"""The daemon's HTTP API as data: each function builds one `Call` (method,
path, request arguments, and how to read the answer) without doing any IO.
`Sandbox` sends them with the blocking client and `AsyncSandbox` with the
asyncio one, so the two stay one implementation.

Streams (command output, template bakes) are read by small state machines
(`CommandStream`, `BakeStream`) fed one NDJSON event at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (Any, Callable, Dict, Generic, List, Mapping, Optional, Sequence, TypeVar,
                    Union, cast)

import httpx

from .exceptions import (ForkboxError, InfrastructureError, TemplateError, from_bake_failure,
                         from_response)
from .models import (CommandResult, EntryInfo, IntegrityReport, ProcessInfo, ProcessOutput,
                     PushResult, TemplateInfo)

T = TypeVar("T")

Json = Dict[str, Any]
Ready = Union[str, Mapping[str, Any], None]
NetworkArg = Mapping[str, Sequence[str]]
LimitsArg = Mapping[str, float]
# Writable disks: `{path: size_mib}`, `{path: {"size_mib": …, "image": …}}`
# or `[{"path": …, "size_mib": …, "image": …}]` (`image` optional).
DisksArg = Union[Mapping[str, int], Sequence[Mapping[str, Any]]]
"""A sandbox's host resources: `{"cpus": 0.5, "memory_mib": 256}`, either
key optional (forkboxd's `SandboxLimits`)."""
"""An egress policy: `{"allow_out": [rule, …], "deny_out": [rule, …]}`."""


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and the reading of its (successful) answer."""

    method: str
    path: str
    kwargs: Dict[str, Any]
    parse: Callable[[httpx.Response], T]
    # A file read or tar download: sent with the clients' `download`,
    # which tells a body cut short from a daemon out of reach.
    download: bool = False


def _json(r: httpx.Response) -> Any:
    return r.json() if r.content else None


def _none(_: httpx.Response) -> None:
    return None


def _true(_: httpx.Response) -> bool:
    return True


def _sb(sandbox_id: str) -> str:
    return f"/sandboxes/{sandbox_id}"


# ------------------------------------------------------------ sandboxes

def create(template: str, timeout: Optional[float], on_timeout: str,
           metadata: Optional[Mapping[str, str]], envs: Optional[Mapping[str, str]],
           wait: Optional[float], network: Optional[NetworkArg] = None,
           seed: Optional[int] = None, limits: Optional[LimitsArg] = None) -> "Call[Json]":
    body: Json = {"template": template, "timeout_secs": timeout, "on_timeout": on_timeout,
                  "metadata": dict(metadata or {}), "envs": dict(envs or {})}
    if wait is not None:
        body["wait_secs"] = wait
    if seed is not None:
        body["seed"] = _seed(seed)
    if network is not None:
        body["network"] = network_policy(network)
    if limits is not None:
        body["limits"] = dict(limits)
    return Call("POST", "/sandboxes", {"json": body}, _json)


def info(sandbox_id: str) -> "Call[Json]":
    return Call("GET", _sb(sandbox_id), {}, _json)


def list_sandboxes(metadata: Optional[Mapping[str, str]]) -> "Call[List[Json]]":
    params = [("label", f"{k}={v}") for k, v in (metadata or {}).items()]
    return Call("GET", "/sandboxes", {"params": params}, _json)


def kill_by_metadata(metadata: Mapping[str, str]) -> "Call[List[str]]":
    return Call("POST", "/sandboxes/kill", {"json": {"metadata": dict(metadata)}},
                lambda r: list(r.json()["killed"]))


def kill(sandbox_id: str) -> "Call[bool]":
    return Call("DELETE", _sb(sandbox_id), {}, _true)


def kill_refused(e: ForkboxError) -> bool:
    """A kill that failed because the sandbox is already dead or unknown
    (`kill` then answers False instead of raising)."""
    return e.kind in ("not_found", "conflict", "guest_ended")


def set_timeout(sandbox_id: str, timeout: Optional[float],
                on_timeout: Optional[str]) -> "Call[Json]":
    body: Json = {"timeout_secs": timeout}
    if on_timeout is not None:
        body["on_timeout"] = on_timeout
    return Call("POST", _sb(sandbox_id) + "/timeout", {"json": body}, _json)


def pause(sandbox_id: str) -> "Call[Json]":
    return Call("POST", _sb(sandbox_id) + "/pause", {}, _json)


def resume(sandbox_id: str) -> "Call[Json]":
    return Call("POST", _sb(sandbox_id) + "/resume", {}, _json)


ForkEntry = Union[Json, ForkboxError]


def _fork_entry(e: Any) -> ForkEntry:
    if isinstance(e, dict) and isinstance(e.get("sandbox"), dict):
        return cast(Json, e["sandbox"])
    if isinstance(e, dict) and "error" in e:
        return from_response(0, e)
    if isinstance(e, dict) and "id" in e:
        return e  # a bare SandboxInfo
    return InfrastructureError(f"unreadable fork entry {e!r}", "infrastructure")


def _fork_entries(r: httpx.Response) -> List[ForkEntry]:
    return [_fork_entry(e) for e in r.json()]


C = TypeVar("C")


class ForkStream(Generic[C]):
    """Reads a streamed fork's lines (`{"index": i, "sandbox"|"error": …}`,
    in the order the children come up): each entry, made a child by
    `child(entry)`, goes to `on_child(i, child)` as it comes; `feed`
    answers the children, in the request's order, once every one has been
    given."""

    def __init__(self, count: int, child: Callable[[ForkEntry], C],
                 on_child: Callable[[int, C], None]) -> None:
        self._children: List[Optional[C]] = [None] * count
        self._given = 0
        self._child = child
        self._on_child = on_child

    def feed(self, ev: Json) -> Optional[List[C]]:
        index = ev.get("index")
        if not isinstance(index, int) or not 0 <= index < len(self._children) \
                or self._children[index] is not None:
            raise InfrastructureError(f"a fork stream line with a bad index: {ev!r}",
                                      "infrastructure")
        child = self._child(_fork_entry(ev))
        self._children[index] = child
        self._given += 1
        self._on_child(index, child)
        if self._given < len(self._children):
            return None
        return [cast(C, c) for c in self._children]

    def ended(self) -> InfrastructureError:
        return InfrastructureError(
            f"the fork's stream ended after {self._given} of {len(self._children)} children "
            "(those given to on_child exist; kill them)", "infrastructure")


def _seed(seed: int) -> int:
    """`seed` as the daemon takes it: an integer 0 to 2**64 - 1."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed {seed!r}: expected an integer from 0 to 2**64 - 1")
    return seed


MAX_FORK_CHILDREN = 1024
"""Most children one fork request asks for (the daemon's limit)."""


def fork(sandbox_id: str, count: int, seed: Optional[int] = None) -> "Call[List[ForkEntry]]":
    """Children in order: each a SandboxInfo, or the error that child met.
    Its `path` and `kwargs` also serve the streamed form (`ForkStream`)."""
    if isinstance(count, bool) or not isinstance(count, int) \
            or not 1 <= count <= MAX_FORK_CHILDREN:
        raise ValueError(f"fork count {count!r}: expected 1-{MAX_FORK_CHILDREN}")
    body: Json = {"count": count}
    if seed is not None:
        body["seed"] = _seed(seed)
    return Call("POST", _sb(sandbox_id) + "/fork", {"json": body}, _fork_entries)


def snapshot(sandbox_id: str, name: str) -> "Call[TemplateInfo]":
    return Call("POST", _sb(sandbox_id) + "/snapshot", {"json": {"name": name}},
                lambda r: TemplateInfo.from_json(r.json(), "ready"))


# ------------------------------------------------------------ network

_POLICY_KEYS = ("allow_out", "deny_out")


def _rules(key: str, rules: Any) -> List[str]:
    if rules is None:
        return []
    if isinstance(rules, (str, bytes)):
        raise TypeError(f"{key} is a list of rules, not one string")
    out = list(rules)
    for r in out:
        if not isinstance(r, str):
            raise TypeError(f"{key}: a rule is a string, not {r!r}")
    return out


def network_policy(network: Optional[NetworkArg] = None, *,
                   allow_out: Optional[Sequence[str]] = None,
                   deny_out: Optional[Sequence[str]] = None) -> Json:
    """A policy body `{"allow_out": […], "deny_out": […]}` from a dict
    and/or the two lists (the keywords win; a list left out is empty).
    `active` (in what `get_network` answers) is dropped, so an answer can
    be sent back. Only the types are checked here: the daemon checks the
    rules, and refuses any other key (`InvalidRequestError`)."""
    if network is not None and not isinstance(network, Mapping):
        raise TypeError(f"network: expected a dict with allow_out/deny_out, not {network!r}")
    body: Json = {k: v for k, v in (network or {}).items() if k != "active"}
    if allow_out is not None:
        body["allow_out"] = allow_out
    if deny_out is not None:
        body["deny_out"] = deny_out
    for k in _POLICY_KEYS:
        body[k] = _rules(k, body.get(k))
    return body


def _policy(r: httpx.Response) -> Json:
    """`{"allow_out", "deny_out", "active"}` (and any field the daemon adds)."""
    d = dict(r.json())
    for k in _POLICY_KEYS:
        d[k] = list(d.get(k) or [])
    return d


def get_network(sandbox_id: str) -> "Call[Json]":
    return Call("GET", _sb(sandbox_id) + "/network", {}, _policy)


def set_network(sandbox_id: str, policy: Json) -> "Call[Json]":
    """Replaces the policy; answers it in normal form."""
    return Call("POST", _sb(sandbox_id) + "/network", {"json": policy}, _policy)


def egress_log(sandbox_id: str, limit: Optional[int]) -> "Call[List[Json]]":
    """The last `limit` records (without one, the daemon's default: 1000),
    oldest first."""
    params: Json = {}
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit {limit}: expected at least 1")
        params["limit"] = int(limit)
    return Call("GET", _sb(sandbox_id) + "/egress", {"params": params},
                lambda r: [dict(rec) for rec in r.json().get("records", [])])


# ------------------------------------------------------------ commands

def exec_body(cmd: Union[str, Sequence[str]], cwd: Optional[str],
              envs: Optional[Mapping[str, str]], user: Optional[Union[str, int]],
              timeout: Optional[float], stdin: Optional[str]) -> Json:
    body: Json = {"envs": dict(envs or {})}
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
    return body


def _result(r: Json, stdout: str, stderr: str) -> CommandResult:
    return CommandResult(stdout=stdout, stderr=stderr, exit_code=r.get("exit_code"),
                         duration=float(r.get("duration_ms", 0.0)) / 1000.0,
                         timed_out=bool(r.get("timed_out")), signal=r.get("signal"))


def run(sandbox_id: str, body: Json) -> "Call[CommandResult]":
    def parse(resp: httpx.Response) -> CommandResult:
        r = resp.json()
        return _result(r, r.get("stdout", ""), r.get("stderr", ""))
    return Call("POST", _sb(sandbox_id) + "/commands", {"json": body}, parse)


def run_stream_path(sandbox_id: str) -> str:
    return _sb(sandbox_id) + "/commands"


class CommandStream:
    """Reads a streamed command's events: output goes to the callbacks and
    is kept; `feed` answers the result at `exit`."""

    def __init__(self, on_stdout: Optional[Callable[[str], None]],
                 on_stderr: Optional[Callable[[str], None]]) -> None:
        self._cb = {"stdout": on_stdout, "stderr": on_stderr}
        self._out: Dict[str, List[str]] = {"stdout": [], "stderr": []}

    def feed(self, ev: Json) -> Optional[CommandResult]:
        t = ev.get("type")
        if t in ("stdout", "stderr"):
            data = str(ev.get("data", ""))
            self._out[t].append(data)
            cb = self._cb[t]
            if cb is not None:
                cb(data)
        elif t == "exit":
            return _result(ev, "".join(self._out["stdout"]), "".join(self._out["stderr"]))
        elif t == "error":
            raise from_response(502, ev)
        return None

    @staticmethod
    def ended() -> InfrastructureError:
        return InfrastructureError("the command's stream ended without a result",
                                   "infrastructure")


# ------------------------------------------------------------ background processes

def _procs(sandbox_id: str) -> str:
    return _sb(sandbox_id) + "/processes"


def run_background(sandbox_id: str, body: Json) -> "Call[int]":
    """Starts the command in the background; answers its pid at once."""
    return Call("POST", _sb(sandbox_id) + "/commands", {"json": dict(body, background=True)},
                lambda r: int(r.json()["pid"]))


def _opt_result(r: Optional[Json]) -> Optional[CommandResult]:
    return None if r is None else _result(r, r.get("stdout", ""), r.get("stderr", ""))


def list_processes(sandbox_id: str) -> "Call[List[ProcessInfo]]":
    def parse(r: httpx.Response) -> List[ProcessInfo]:
        return [ProcessInfo(pid=int(p["pid"]), cmd=p.get("cmd"), argv=p.get("argv"),
                            background=bool(p.get("background")),
                            running=bool(p.get("running")),
                            duration=float(p.get("duration_ms", 0.0)) / 1000.0,
                            result=_opt_result(p.get("result"))) for p in r.json()]
    return Call("GET", _procs(sandbox_id), {}, parse)


def wait_process(sandbox_id: str, pid: int, timeout: Optional[float]) -> "Call[CommandResult]":
    """Its result with the output the guest kept; still running at
    `timeout` raises `ProcessTimeoutError`."""
    body: Json = {} if timeout is None else {"timeout_secs": timeout}
    # The HTTP request lasts as long as the wait, plus room to answer.
    http_timeout = httpx.Timeout(None if timeout is None else timeout + 60.0, connect=10.0)
    return Call("POST", f"{_procs(sandbox_id)}/{pid}/wait",
                {"json": body, "timeout": http_timeout},
                lambda r: _opt_result(r.json()) or _result({}, "", ""))


def kill_process(sandbox_id: str, pid: int, signal: int) -> "Call[bool]":
    return Call("POST", f"{_procs(sandbox_id)}/{pid}/kill", {"json": {"signal": signal}}, _true)


def kill_process_refused(e: ForkboxError) -> bool:
    """A kill of a process that already ended (or never was)."""
    return e.kind == "guest" and e.detail.get("guest_kind") == "not_found"


def process_stdin(sandbox_id: str, pid: int, data: Union[str, bytes],
                  close: bool) -> "Call[int]":
    raw = data.encode() if isinstance(data, str) else data
    return Call("POST", f"{_procs(sandbox_id)}/{pid}/stdin",
                {"params": {"close": str(close).lower()}, "content": raw,
                 "headers": {"Content-Type": "application/octet-stream"}},
                lambda r: int(r.json()["bytes"]))


def process_output(sandbox_id: str, pid: int) -> "Call[ProcessOutput]":
    def parse(resp: httpx.Response) -> ProcessOutput:
        r = resp.json()
        return ProcessOutput(stdout=str(r.get("stdout", "")), stderr=str(r.get("stderr", "")),
                             dropped_bytes=int(r.get("dropped_bytes", 0)),
                             running=bool(r.get("running")),
                             result=_opt_result(r.get("result")))
    return Call("GET", f"{_procs(sandbox_id)}/{pid}/output", {}, parse)


def follow_output_path(sandbox_id: str, pid: int) -> str:
    """Streamed (NDJSON) with `params={"follow": "true"}`: the output so far,
    then as it comes, then `exit`: read it with `CommandStream`."""
    return f"{_procs(sandbox_id)}/{pid}/output"


FOLLOW = {"params": {"follow": "true"}, "timeout": httpx.Timeout(None, connect=10.0)}


# ------------------------------------------------------------ ports

def open_port(sandbox_id: str, port: int, wait: Optional[float]) -> "Call[str]":
    """Opens (or finds) the forward of guest `port`; answers the host
    address `127.0.0.2:NNNNN`."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port}: expected 1-65535")
    body: Json = {"port": port}
    if wait is not None:
        body["wait_secs"] = wait
    return Call("POST", _sb(sandbox_id) + "/ports", {"json": body},
                lambda r: str(r.json()["host"]))


def list_ports(sandbox_id: str) -> "Call[Dict[int, str]]":
    return Call("GET", _sb(sandbox_id) + "/ports", {},
                lambda r: {int(f["port"]): str(f["host"]) for f in r.json()})


def close_port(sandbox_id: str, port: int) -> "Call[None]":
    return Call("DELETE", f"{_sb(sandbox_id)}/ports/{port}", {}, _none)


# ------------------------------------------------------------ files

def _files(sandbox_id: str) -> str:
    return _sb(sandbox_id) + "/files"


def _path_params(path: str, user: Optional[Union[str, int]],
                 **more: Any) -> Dict[str, Any]:
    """A file call's query: its path, the user it acts as when given
    (otherwise the daemon's default, the image's unprivileged `user`), and
    `more` where not None."""
    params: Dict[str, Any] = {"path": path}
    if user is not None:
        params["user"] = str(user)
    params.update({k: v for k, v in more.items() if v is not None})
    return params


def _download_params(path: str, max_bytes: Optional[int],
                     user: Optional[Union[str, int]] = None) -> Dict[str, Any]:
    return _path_params(path, user, max_bytes=max_bytes)


def read_file(sandbox_id: str, path: str, format: str, max_bytes: Optional[int] = None,
              user: Optional[Union[str, int]] = None) -> "Call[Union[str, bytes]]":
    if format not in ("text", "bytes"):
        raise ValueError(f"format {format!r}: expected 'text' or 'bytes'")

    def parse(r: httpx.Response) -> Union[str, bytes]:
        return r.content if format == "bytes" else r.content.decode("utf-8", errors="replace")
    return Call("GET", _files(sandbox_id), {"params": _download_params(path, max_bytes, user)},
                parse, download=True)


def write_file(sandbox_id: str, path: str, data: Union[str, bytes], mode: int,
               user: Optional[Union[str, int]] = None) -> "Call[int]":
    raw = data.encode() if isinstance(data, str) else data
    return Call("PUT", _files(sandbox_id),
                {"params": _path_params(path, user, mode=f"{mode:o}"), "content": raw},
                lambda r: int(r.json()["bytes"]))


def list_dir(sandbox_id: str, path: str,
             user: Optional[Union[str, int]] = None) -> "Call[List[EntryInfo]]":
    def parse(r: httpx.Response) -> List[EntryInfo]:
        return [EntryInfo(name=e["name"], path=e["path"], type=e["kind"], size=e["size"],
                          mode=e["mode"], mtime=e["mtime"]) for e in r.json()]
    return Call("GET", _files(sandbox_id) + "/list", {"params": _path_params(path, user)}, parse)


def stat(sandbox_id: str, path: str, user: Optional[Union[str, int]] = None) -> "Call[Json]":
    return Call("GET", _files(sandbox_id) + "/stat", {"params": _path_params(path, user)}, _json)


def remove(sandbox_id: str, path: str, recursive: bool,
           user: Optional[Union[str, int]] = None) -> "Call[None]":
    return Call("DELETE", _files(sandbox_id),
                {"params": _path_params(path, user, recursive=str(recursive).lower())}, _none)


def make_dir(sandbox_id: str, path: str, user: Optional[Union[str, int]] = None) -> "Call[None]":
    return Call("POST", _files(sandbox_id) + "/mkdir", {"params": _path_params(path, user)},
                _none)


def upload_tar(sandbox_id: str, path: str, tar_bytes: bytes,
               user: Optional[Union[str, int]] = None) -> "Call[int]":
    return Call("PUT", _files(sandbox_id) + "/tar", {"params": _path_params(path, user),
                                                     "content": tar_bytes},
                lambda r: int(r.json()["bytes"]))


def download_tar(sandbox_id: str, path: str, max_bytes: Optional[int] = None,
                 user: Optional[Union[str, int]] = None) -> "Call[bytes]":
    return Call("GET", _files(sandbox_id) + "/tar",
                {"params": _download_params(path, max_bytes, user)}, lambda r: r.content,
                download=True)


# ------------------------------------------------------------ templates

def template_spec(name: str, image: str, vcpus: int, memory_mib: int,
                  setup: Optional[Sequence[str]], ready: Ready, ready_timeout: Optional[float],
                  envs: Optional[Mapping[str, str]],
                  network: Optional[NetworkArg] = None,
                  protect: Optional[Sequence[str]] = None,
                  limits: Optional[LimitsArg] = None, run_image_cmd: bool = False,
                  disks: Optional[DisksArg] = None) -> Json:
    """A TemplateSpec body. `ready`: a shell command (exit 0 = ready), or
    one of `{"command": …}`, `{"file": path}`, `{"tcp_port": n}`,
    `{"http_url": url}`. `network`: the egress policy while it bakes.
    `protect`: paths the policy may not change. `limits`: each sandbox's
    host resources. `run_image_cmd`: start the stored image's
    `Entrypoint`/`Cmd` in the background before the readiness check.
    `disks`: writable disks, `{path: size_mib}`, `{path: {"size_mib": …,
    "image": …}}` or a list of `{"path": …, "size_mib": …, "image": …}`
    (`image`: a stored image whose files the disk starts with)."""
    if isinstance(setup, str):
        raise TypeError("setup is a list of shell commands, not one string")
    if isinstance(protect, str):
        raise TypeError("protect is a list of paths, not one string")
    spec: Json = {"name": name, "image": image, "vcpus": vcpus, "memory_mib": memory_mib,
                  "setup": list(setup or []), "envs": dict(envs or {})}
    if ready is not None:
        spec["ready"] = {"command": ready} if isinstance(ready, str) else dict(ready)
    if ready_timeout is not None:
        spec["ready_timeout_secs"] = int(ready_timeout)
    if network is not None:
        spec["network"] = network_policy(network)
    if protect:
        spec["protect"] = list(protect)
    if limits:
        spec["limits"] = dict(limits)
    if run_image_cmd:
        spec["run_image_cmd"] = True
    if disks:
        spec["disks"] = template_disks(disks)
    return spec


def template_disks(disks: DisksArg) -> List[Json]:
    """`{"/var/lib/docker": 4096}`, `{"/workspace": {"size_mib": 1024,
    "image": "task/repo:1"}}` or `[{"path": …, "size_mib": …}]` as the
    API's list."""
    if isinstance(disks, Mapping):
        disks = [dict(v, path=p) if isinstance(v, Mapping) else {"path": p, "size_mib": v}
                 for p, v in disks.items()]
    out = []
    for d in disks:
        if not isinstance(d, Mapping) or not {"path", "size_mib"} <= set(d) \
                or not set(d) <= {"path", "size_mib", "image"}:
            raise TypeError("a disk is {'path': str, 'size_mib': int} and optionally "
                            f"'image': str, not {d!r}")
        disk: Json = {"path": str(d["path"]), "size_mib": int(d["size_mib"])}
        if d.get("image") is not None:
            disk["image"] = str(d["image"])
        out.append(disk)
    return out


def integrity(sandbox_id: str) -> "Call[IntegrityReport]":
    return Call("GET", _sb(sandbox_id) + "/integrity", {},
                lambda r: IntegrityReport.from_json(r.json()))


def list_templates() -> "Call[List[TemplateInfo]]":
    return Call("GET", "/templates", {}, lambda r: [TemplateInfo.from_json(t) for t in r.json()])


def get_template(name: str) -> "Call[TemplateInfo]":
    return Call("GET", f"/templates/{name}", {}, lambda r: TemplateInfo.from_json(r.json()))


def save_template(name: str) -> "Call[TemplateInfo]":
    return Call("POST", f"/templates/{name}/save", {}, lambda r: TemplateInfo.from_json(r.json()))


def delete_template(name: str) -> "Call[None]":
    return Call("DELETE", f"/templates/{name}", {}, _none)


def bake_path(name: str) -> str:
    return f"/templates/{name}/bake"


def push_path(name: str) -> str:
    return f"/templates/{name}/push"


def pull_path(name: str) -> str:
    return f"/templates/{name}/pull"


def registry_body(reference: str, plain_http: bool, username: Optional[str],
                  password: Optional[str]) -> Json:
    """A push's or a pull's body: the reference and how to reach it."""
    return {"reference": reference, "plain_http": plain_http, "username": username,
            "password": password}


def pulled_name(reference: str) -> str:
    """A pulled template's default name: its repository's last part
    (`pytest-env` for `host:5000/team/pytest-env:v3`)."""
    path = reference.split("@")[0]
    return path.rsplit("/", 1)[-1].split(":")[0]


class BakeStream:
    """Reads a bake's events: each goes to `on_progress`; `feed` answers
    the template at `done` and raises `TemplateError` at `failed`."""

    def __init__(self, on_progress: Optional[Callable[[Json], None]]) -> None:
        self._cb = on_progress

    def feed(self, ev: Json) -> Any:
        if self._cb is not None:
            self._cb(ev)
        if ev.get("type") == "failed":
            raise from_bake_failure(ev)
        return self._end(ev)

    def _end(self, ev: Json) -> Any:
        """The result at the stream's last event; `None` before."""
        if ev.get("type") == "done":
            return TemplateInfo.from_json(ev.get("template") or {}, "ready")
        return None

    @staticmethod
    def ended() -> TemplateError:
        return from_bake_failure({"step": "stream", "kind": "infrastructure",
                                  "message": "the bake's stream ended without done or failed"})


class RegistryStream(BakeStream):
    """Reads a push's or a pull's events as `BakeStream` reads a bake's:
    `feed` answers a `PushResult` at `pushed`, the template at `pulled`."""

    def _end(self, ev: Json) -> Optional[Union[PushResult, TemplateInfo]]:
        t = ev.get("type")
        if t == "pushed":
            return PushResult(reference=str(ev["reference"]), digest=str(ev["digest"]),
                              sent_bytes=int(ev["sent_bytes"]),
                              present_bytes=int(ev["present_bytes"]),
                              total_ms=int(ev["total_ms"]))
        if t == "pulled":
            return TemplateInfo.from_json(ev.get("template") or {}, "ready")
        return None

    @staticmethod
    def ended() -> TemplateError:
        return from_bake_failure({"step": "stream", "kind": "infrastructure",
                                  "message": "the transfer's stream ended without its end"})
