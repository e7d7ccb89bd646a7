"""Errors raised by the SDK, mirroring the daemon's error kinds."""

from __future__ import annotations

from typing import Any, Dict, Optional


class ForkboxError(Exception):
    """Any error the daemon reported, with its kind and HTTP status."""

    def __init__(self, message: str, kind: str = "", status: int = 0,
                 detail: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.detail = detail or {}

    @property
    def infrastructure(self) -> bool:
        """True when the sandbox infrastructure failed, not your request
        or command: mask such episodes instead of scoring them."""
        return bool(self.detail.get("infrastructure"))


class InvalidRequestError(ForkboxError):
    pass


class UnsafeArchiveError(ForkboxError):
    """A tar archive from a guest (`download_dir`) has a member that cannot
    be unpacked safely (an absolute path, `..`, a link leading out, a
    device, ...). `member` names it; what came before it was unpacked."""

    def __init__(self, member: str, why: str) -> None:
        super().__init__(f"tar member {member!r} {why}", kind="unsafe_archive")
        self.member = member


class NotFoundError(ForkboxError):
    """Unknown sandbox or template, or (from the guest) a missing path."""


class ConflictError(ForkboxError):
    """The sandbox is not in a state that allows this (e.g. dead)."""


class CapacityError(ForkboxError):
    """The daemon's cap on live or creating sandboxes was reached."""


class UnsupportedError(ForkboxError):
    """Not available yet in this daemon (fork, pause before they land)."""


class AuthenticationError(ForkboxError):
    pass


class TemplateError(ForkboxError):
    """A template's bake failed: `step` (`boot`, `setup[N]`, `ready`, …)
    and the tail of its `output`."""

    @property
    def step(self) -> str:
        return str(self.detail.get("step") or "")

    @property
    def output(self) -> str:
        return str(self.detail.get("output") or "")


class ProcessTimeoutError(ForkboxError, TimeoutError):
    """A wait for a background process ended before the process did (it
    runs on). Also a builtin `TimeoutError`."""


class TooLargeError(ForkboxError):
    """A request body, or a file read or tar download, over its limit
    (HTTP 413, kind `too_large`). A read or download asks for more with
    `max_bytes=` (default 256 MiB, at most the daemon's
    `--max-download-bytes`). Raised too when the limit was passed after
    the download's answer started (the daemon's last frame says so)."""


class GuestTimeoutError(ForkboxError, TimeoutError):
    """The guest did not finish a call in time (HTTP 504, kind
    `guest_timeout`): a file that never ends, an agent that does not
    answer. The guest's doing, not the infrastructure's. Also a builtin
    `TimeoutError`."""


class GuestEndedError(ForkboxError):
    """The sandbox's guest ended its own VM (HTTP 410, kind
    `guest_ended`): it powered off, rebooted, or its kernel panicked (a
    sysrq crash, an oops). The sandbox is dead. The guest's doing, not the
    infrastructure's: score such an episode as the policy's failure, don't
    mask it."""


class TamperedError(ForkboxError):
    """A rollout changed its protected paths (its template's `protect`:
    the grader, the tests): its result is withheld. `report` is the
    `IntegrityReport` saying which paths. The policy's doing, not the
    infrastructure's: score it as a failure, don't mask it."""

    def __init__(self, report: Any) -> None:
        paths = report.tampered
        shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
        super().__init__(f"the rollout changed protected paths: {shown}", kind="tampered",
                         detail={"infrastructure": False, "tampered": paths})
        self.report = report


class InfrastructureError(ForkboxError):
    """The sandbox machinery failed (VM died, agent unreachable)."""


class DownloadInterruptedError(InfrastructureError):
    """A file read or tar download whose stream stopped before the
    daemon said how it ended: the daemon or the connection to it went
    away mid-stream. Infrastructure: a guest's failure (a limit passed,
    a guest that did not answer, a VM that died) is its own error."""


class TemplateInfrastructureError(TemplateError, InfrastructureError):
    """A bake failed because the machinery did (the VM, not the recipe):
    both a `TemplateError` and an `InfrastructureError`."""


class DaemonUnavailableError(InfrastructureError):
    """The daemon could not be reached."""

    @property
    def infrastructure(self) -> bool:
        return True


_BY_KIND = {
    "invalid_request": InvalidRequestError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "capacity": CapacityError,
    "unsupported": UnsupportedError,
    "unauthorized": AuthenticationError,
    "template_failed": TemplateError,
    "infrastructure": InfrastructureError,
    "timeout": ProcessTimeoutError,
    "too_large": TooLargeError,
    "guest_timeout": GuestTimeoutError,
    "guest_ended": GuestEndedError,
}


def from_response(status: int, body: Any) -> ForkboxError:
    """The error for an error body `{"error": {kind, message, …}}`."""
    detail = body.get("error") if isinstance(body, dict) else None
    if not isinstance(detail, dict):
        return ForkboxError(f"HTTP {status}: {body!r}", "", status)
    kind = str(detail.get("kind", ""))
    if kind == "guest":
        cls = {"not_found": NotFoundError,
               "connection_refused": ConflictError}.get(str(detail.get("guest_kind")),
                                                        ForkboxError)
    else:
        cls = _BY_KIND.get(kind, ForkboxError)
    return cls(str(detail.get("message", "")), kind, status, detail)


def from_cut_download(received: int) -> ForkboxError:
    """The error for a download whose body stopped after `received`
    bytes without its last frame."""
    return DownloadInterruptedError(
        f"the download stopped after {received} bytes before the daemon said how it ended: "
        f"the daemon or the connection to it went away mid-stream (see the daemon's log)",
        "interrupted", 200, {"kind": "interrupted", "infrastructure": True})


def from_bake_failure(event: Dict[str, Any]) -> TemplateError:
    """The error for a bake stream's last line `{"type": "failed", step,
    kind, message, output}`."""
    kind = str(event.get("kind", "template_failed"))
    detail = {"kind": kind, "message": event.get("message", ""), "step": event.get("step"),
              "output": event.get("output", ""), "infrastructure": kind == "infrastructure"}
    cls = TemplateInfrastructureError if kind == "infrastructure" else TemplateError
    step = event.get("step") or "?"
    return cls(f"step {step}: {event.get('message', '')}", kind, 200, detail)
