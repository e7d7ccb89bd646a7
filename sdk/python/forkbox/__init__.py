"""forkbox: hardware-isolated microVM sandboxes from forkboxd.

    from forkbox import Sandbox
    with Sandbox.create("minimal", metadata={"run": "1"}) as sb:
        print(sb.commands.run("echo hi").stdout)
        children = sb.fork(count=4)          # Sandboxes (or per-child errors)

The daemon is found through `FORKBOX_URL` (`unix:///path` or
`http://host:port`), else its default socket.

Modules:
- `sandbox`: `Sandbox` (blocking): create, commands, files, network
  (egress policy and log), fork, pause, snapshots.
- `async_sandbox`: `AsyncSandbox`, the same for asyncio.
- `template`: `Template` / `AsyncTemplate`: build (bake) a template from a
  recipe, streaming its progress; list, delete.
- `rollouts`: `group` / `agroup`: fork N sandboxes from one state, run a
  function in each, collect results and errors, kill them all.
- `gym`: `SandboxEnv`, a Gymnasium environment (imported on its own, as it
  needs `gymnasium`).
- `grading`: `grade_in_fresh_sandbox`: grade a rollout in a fresh sandbox
  of its template with only its declared outputs carried over.
- `replay`: `replay`: a scripted trajectory run twice from one state and
  seed, the runs compared.
- `exceptions`: one class per daemon error kind; `.infrastructure` tells
  the machinery's failures from yours.
- `_api`: the HTTP API as data (no IO), shared by the blocking and async
  classes; `_client`: the connections.
"""

from ._client import AsyncClient, Client, default_url
from .async_sandbox import AsyncSandbox
from .async_sandbox import AsyncCommandHandle, AsyncIntegrity, AsyncNetwork
from .exceptions import (AuthenticationError, CapacityError, ConflictError,
                         DaemonUnavailableError, ForkboxError, InfrastructureError,
                         InvalidRequestError, NotFoundError, ProcessTimeoutError, TemplateError,
                         TemplateInfrastructureError, UnsafeArchiveError, UnsupportedError,
                         TooLargeError, GuestTimeoutError, GuestEndedError,
                         DownloadInterruptedError, TamperedError)
from .models import (CommandResult, EntryInfo, IntegrityReport, ProcessInfo, ProcessOutput,
                     PushResult, TemplateInfo)
from .sandbox import CommandHandle, Integrity, Network, Sandbox
from .template import AsyncTemplate, Template

__all__ = [
    "Sandbox", "AsyncSandbox", "Template", "AsyncTemplate", "CommandResult", "EntryInfo",
    "TemplateInfo", "PushResult", "Client", "AsyncClient", "default_url", "ForkboxError",
    "InvalidRequestError", "NotFoundError", "ConflictError", "CapacityError",
    "UnsupportedError", "AuthenticationError", "TemplateError", "TemplateInfrastructureError",
    "InfrastructureError", "DaemonUnavailableError", "TooLargeError", "GuestTimeoutError",
    "DownloadInterruptedError", "CommandHandle", "AsyncCommandHandle",
    "ProcessInfo", "ProcessOutput", "ProcessTimeoutError", "Network", "AsyncNetwork",
    "UnsafeArchiveError", "GuestEndedError", "TamperedError", "IntegrityReport", "Integrity", "AsyncIntegrity",
]
