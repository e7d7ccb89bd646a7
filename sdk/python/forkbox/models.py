"""The SDK's plain result types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: Optional[int]
    """`None` when a signal ended the command (see `signal`)."""
    duration: float
    """Seconds, measured by the guest agent."""
    timed_out: bool
    signal: Optional[int] = None


@dataclass
class ProcessInfo:
    """A process `sb.commands.list()` shows: a background process
    (running, or among the last 64 that ended) or a command a client is
    waiting on."""

    pid: int
    cmd: Optional[str]
    """The shell command (`None` if it was started from an argv list)."""
    argv: Optional[List[str]]
    background: bool
    running: bool
    duration: float
    """Seconds it has run (until it ended)."""
    result: Optional[CommandResult]
    """How it ended (no output here: see `CommandHandle.output()`);
    `None` while it runs."""


@dataclass
class ProcessOutput:
    """What a background process wrote so far (the guest keeps its last
    1 MiB of output)."""

    stdout: str
    stderr: str
    dropped_bytes: int
    """Output the guest's buffer no longer held."""
    running: bool
    result: Optional[CommandResult]
    """How it ended; `None` while it runs."""


@dataclass
class EntryInfo:
    name: str
    path: str
    type: str
    """`file`, `dir`, `symlink` or `other`."""
    size: int
    mode: int
    mtime: int


@dataclass
class PushResult:
    """What `Template.push` sent."""

    reference: str
    digest: str
    """The artifact's manifest (`sha256:…`): pull `repo@digest` for exactly this."""
    sent_bytes: int
    present_bytes: int
    """Bytes the registry had already (an image's shared layers, a second push)."""
    total_ms: int


@dataclass
class TemplateInfo:
    """A template as `GET /templates` shows it."""

    name: str
    image: str
    vcpus: int
    memory_mib: int
    setup: List[str]
    ready: Optional[Dict[str, Any]]
    """`{"command": "…"}`, `{"file": "/path"}`, `{"tcp_port": 8080}` or
    `{"http_url": "http://…"}`; `None`: ready once booted and set up."""
    ready_timeout_secs: int
    envs: Dict[str, str]
    state: str
    """`not_baked`, `baking`, `ready` or `failed`."""
    from_sandbox: Optional[str]
    """The sandbox a snapshot template was taken from; `None` otherwise."""
    protect: List[str] = field(default_factory=list)
    """Paths the policy may not change (grader, tests): root's and
    read-only to others from the end of the bake, recorded then."""
    limits: Dict[str, float] = field(default_factory=dict)
    """Each sandbox's host resources (`cpus`, `memory_mib`); empty: what
    its shape gets."""
    error: Optional[str] = None
    """Why the last bake failed."""
    bake_ms: Optional[int] = None
    run_image_cmd: bool = False
    """Its stored image's `Entrypoint`/`Cmd` runs in the background in
    every sandbox (started before the readiness check, at the bake)."""
    image_id: Optional[str] = None
    """The stored image it boots (`sha256:…`), as found when it was made:
    moving the image's name later changes nothing for it. `None`: a
    built-in image."""
    saved_bytes: Optional[int] = None
    """Bytes of its zygote's snapshot in the daemon's state directory
    (`Template.save`); `None`: not saved, a restarted daemon bakes it."""
    disks: List[Dict[str, Any]] = field(default_factory=list)
    """Its writable disks: `{"path": …, "size_mib": …}` each, with `image`
    and the `image_id` it named when the disk starts with an image's files."""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)
    """The daemon's whole object, fields this SDK does not know included."""

    @classmethod
    def from_json(cls, d: Dict[str, Any], default_state: str = "not_baked") -> "TemplateInfo":
        return cls(name=str(d["name"]), image=str(d.get("image", "")),
                   vcpus=int(d.get("vcpus", 1)), memory_mib=int(d.get("memory_mib", 0)),
                   setup=list(d.get("setup") or []), ready=d.get("ready"),
                   ready_timeout_secs=int(d.get("ready_timeout_secs", 0)),
                   envs=dict(d.get("envs") or {}), state=str(d.get("state", default_state)),
                   from_sandbox=d.get("from_sandbox"), error=d.get("error"),
                   protect=list(d.get("protect") or []),
                   limits=dict(d.get("limits") or {}),
                   bake_ms=d.get("bake_ms"), image_id=d.get("image_id"),
                   run_image_cmd=bool(d.get("run_image_cmd", False)),
                   disks=list(d.get("disks") or []),
                   saved_bytes=d.get("saved_bytes"), raw=dict(d))


@dataclass
class IntegrityReport:
    """Whether a sandbox's protected paths (its template's `protect`) still
    hold what the template's bake recorded (`sb.integrity.check()`).
    Truthy when intact."""

    intact: bool
    """Nothing protected changed (also True when nothing is protected)."""
    protected: List[str]
    changed: List[str]
    """Paths whose content, type, owner or permissions differ."""
    added: List[str]
    """Paths under a protected path that were not there at the bake."""
    removed: List[str]
    """Paths recorded at the bake that are gone."""
    entries: int
    """Entries recorded at the bake."""

    def __bool__(self) -> bool:
        return self.intact

    @property
    def tampered(self) -> List[str]:
        """Every changed, added and removed path, sorted."""
        return sorted(self.changed + self.added + self.removed)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "IntegrityReport":
        return cls(intact=bool(d["intact"]), protected=list(d.get("protected") or []),
                   changed=list(d.get("changed") or []), added=list(d.get("added") or []),
                   removed=list(d.get("removed") or []), entries=int(d.get("entries", 0)))
