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


class InfrastructureError(ForkboxError):
    """The sandbox machinery failed (VM died, agent unreachable)."""


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


def from_bake_failure(event: Dict[str, Any]) -> TemplateError:
    """The error for a bake stream's last line `{"type": "failed", step,
    kind, message, output}`."""
    kind = str(event.get("kind", "template_failed"))
    detail = {"kind": kind, "message": event.get("message", ""), "step": event.get("step"),
              "output": event.get("output", ""), "infrastructure": kind == "infrastructure"}
    cls = TemplateInfrastructureError if kind == "infrastructure" else TemplateError
    step = event.get("step") or "?"
    return cls(f"step {step}: {event.get('message', '')}", kind, 200, detail)
