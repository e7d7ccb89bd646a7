"""forkbox: hardware-isolated microVM sandboxes from forkboxd.

    from forkbox import Sandbox
    with Sandbox.create("minimal", metadata={"run": "1"}) as sb:
        print(sb.commands.run("echo hi").stdout)

The daemon is found through `FORKBOX_URL` (`unix:///path` or
`http://host:port`), else its default socket.
"""

from ._client import Client, default_url
from .exceptions import (AuthenticationError, CapacityError, ConflictError,
                         DaemonUnavailableError, ForkboxError, InfrastructureError,
                         InvalidRequestError, NotFoundError, TemplateError, UnsupportedError)
from .sandbox import CommandResult, EntryInfo, Sandbox

__all__ = [
    "Sandbox", "CommandResult", "EntryInfo", "Client", "default_url", "ForkboxError",
    "InvalidRequestError", "NotFoundError", "ConflictError", "CapacityError",
    "UnsupportedError", "AuthenticationError", "TemplateError", "InfrastructureError",
    "DaemonUnavailableError",
]
