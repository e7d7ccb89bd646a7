"""Templates: an image, resources and a ready recipe, baked once into a
zygote that every sandbox created from the template is forked from.

    info = Template.build("py", image="debian", setup=["apt-get install -y python3"],
                          ready="python3 -c 1", on_progress=print)
    sb = Sandbox.create("py")
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _api
from ._api import DisksArg, LimitsArg, NetworkArg, Ready
from ._client import AsyncClient, Client, shared_async_client, shared_client
from .models import PushResult, TemplateInfo
from .sandbox import _do
from .async_sandbox import _do as _ado

ProgressCallback = Callable[[Dict[str, Any]], None]


class Template:
    """Blocking template calls (`AsyncTemplate` for asyncio)."""

    @staticmethod
    def build(name: str, *, image: str = "minimal", vcpus: int = 1, memory_mib: int = 512,
              setup: Optional[Sequence[str]] = None, ready: Ready = None,
              ready_timeout: Optional[float] = None, envs: Optional[Mapping[str, str]] = None,
              network: Optional[NetworkArg] = None,
              protect: Optional[Sequence[str]] = None,
              limits: Optional[LimitsArg] = None,
              run_image_cmd: bool = False,
              disks: Optional[DisksArg] = None,
              on_progress: Optional[ProgressCallback] = None,
              url: Optional[str] = None) -> TemplateInfo:
        """Registers and bakes a template: boot `image`, run each `setup`
        shell command as root (each must exit 0), wait up to
        `ready_timeout` seconds for `ready` (a shell command that exits 0
        when ready, or `{"file": path}`, `{"tcp_port": n}`,
        `{"http_url": url}`), then keep the VM as the template's zygote.

        `network`: the egress policy while it bakes (`{"allow_out": […],
        "deny_out": […]}`, as `Sandbox.create`'s), e.g. the package
        mirrors `setup` needs. It holds only for the bake: sandboxes
        created from the template start with their own (default: deny
        all).

        `protect`: paths the policy may not change (the grader, the tests,
        the task; at most 64, each must exist after setup). At the end of
        the bake they become root's and read-only to everyone else, and
        what they hold is recorded: `sb.integrity.check()` on any sandbox
        of the template (or fork of one) says what changed since.

        `limits`: the host resources each sandbox of it may take,
        `{"cpus": 0.5, "memory_mib": 256}` (as `Sandbox.create`'s, which
        may set its own); the bake runs without them.

        `run_image_cmd`: start a stored image's `Entrypoint` and `Cmd` (its
        service) in the background after `setup` and before `ready`, as
        the image's `User` (root when it names none), in its `WorkingDir`;
        every sandbox of the template then has it running.

        `disks`: writable disks, `{"/var/lib/docker": 4096}` (path: size in
        MiB, at most 4), each an empty ext4 file system mounted before
        `setup` runs; `{"/workspace": {"size_mib": 1024, "image":
        "task/repo:1"}}` starts it with a stored image's files instead
        (laid out once per image and size, shared, never copied per
        sandbox). What the setup writes there is in every sandbox;
        each sandbox's writes are its own, a fork's children start from
        its disk at the instant of its memory, and only written blocks
        take host disk (gone with the sandbox). A template with disks can
        be saved, not pushed (yet).

        `on_progress` gets every event of the bake as a dict: `{"type":
        "step", "step", "detail"}`, `{"type": "output", "stream", "data"}`,
        and the last one, `done` (with `boot_ms`, `total_ms`) or `failed`.
        A failed bake raises `TemplateError` (`.step`, `.output`);
        `TemplateInfrastructureError` when the VM failed, not the recipe."""
        spec = _api.template_spec(name, image, vcpus, memory_mib, setup, ready, ready_timeout,
                                  envs, network, protect, limits, run_image_cmd,
                                  disks)
        return _bake(shared_client(url), ("POST", "/templates"), on_progress, json=spec)

    @staticmethod
    def bake(name: str, *, on_progress: Optional[ProgressCallback] = None,
             url: Optional[str] = None) -> TemplateInfo:
        """Bakes a registered template that is not baked yet (the built-in
        `minimal` and `debian` are baked on first use otherwise); a ready
        one answers at once. Events and errors as in `build`."""
        return _bake(shared_client(url), ("POST", _api.bake_path(name)), on_progress)

    @staticmethod
    def list(url: Optional[str] = None) -> List[TemplateInfo]:
        return _do(shared_client(url), _api.list_templates())

    @staticmethod
    def get(name: str, url: Optional[str] = None) -> TemplateInfo:
        return _do(shared_client(url), _api.get_template(name))

    @staticmethod
    def save(name: str, url: Optional[str] = None) -> TemplateInfo:
        """Saves a baked template's zygote in the daemon's state directory:
        a restarted daemon (even after a reboot) starts it from there
        instead of baking. Its `saved_bytes` says how much was written."""
        return _do(shared_client(url), _api.save_template(name))

    @staticmethod
    def push(name: str, reference: str, *, plain_http: bool = False,
             username: Optional[str] = None, password: Optional[str] = None,
             on_progress: Optional[ProgressCallback] = None,
             url: Optional[str] = None) -> PushResult:
        """Pushes a baked template to a registry (`host[:port]/repo:tag`)
        as one OCI artifact: its zygote's snapshot (the memory compressed)
        and, for a stored image, the image whole; blobs the registry has
        are not sent again. Saved first (`save`) if it was not.
        `plain_http`: a registry on loopback. `on_progress` gets each
        event: `step`, `progress` (`what`, `bytes`, `total`, `present`),
        and the last, `pushed` or `failed` (raised as `TemplateError`)."""
        body = _api.registry_body(reference, plain_http, username, password)
        return shared_client(url).follow_ndjson("POST", _api.push_path(name),
                                                _api.RegistryStream(on_progress), json=body)

    @staticmethod
    def pull(reference: str, *, name: Optional[str] = None, plain_http: bool = False,
             username: Optional[str] = None, password: Optional[str] = None,
             on_progress: Optional[ProgressCallback] = None,
             url: Optional[str] = None) -> TemplateInfo:
        """Pulls a pushed template as `name` (default: the repository's
        last part) and starts its zygote from the snapshot, without a bake:
        sandboxes fork from it at once, and it is saved here (a restarted
        daemon keeps it). Its image comes with it. A template on a built-in
        image needs this host's disk of that image to be the same bytes;
        one on a stored image travels anywhere. Events and errors as in
        `push`; the last is `pulled`."""
        body = _api.registry_body(reference, plain_http, username, password)
        path = _api.pull_path(name or _api.pulled_name(reference))
        return shared_client(url).follow_ndjson("POST", path,
                                                _api.RegistryStream(on_progress), json=body)

    @staticmethod
    def delete(name: str, url: Optional[str] = None) -> None:
        _do(shared_client(url), _api.delete_template(name))


def _bake(client: Client, route: Tuple[str, str], on_progress: Optional[ProgressCallback],
          **kw: Any) -> TemplateInfo:
    return client.follow_ndjson(*route, _api.BakeStream(on_progress), **kw)


async def _abake(client: AsyncClient, route: Tuple[str, str],
                 on_progress: Optional[ProgressCallback], **kw: Any) -> TemplateInfo:
    return await client.follow_ndjson(*route, _api.BakeStream(on_progress), **kw)


class AsyncTemplate:
    """`Template` for asyncio; same arguments and errors."""

    @staticmethod
    async def build(name: str, *, image: str = "minimal", vcpus: int = 1,
                    memory_mib: int = 512, setup: Optional[Sequence[str]] = None,
                    ready: Ready = None, ready_timeout: Optional[float] = None,
                    envs: Optional[Mapping[str, str]] = None,
                    network: Optional[NetworkArg] = None,
                    protect: Optional[Sequence[str]] = None,
                    limits: Optional[LimitsArg] = None,
                    run_image_cmd: bool = False,
                    disks: Optional[DisksArg] = None,
                    on_progress: Optional[ProgressCallback] = None,
                    url: Optional[str] = None) -> TemplateInfo:
        spec = _api.template_spec(name, image, vcpus, memory_mib, setup, ready, ready_timeout,
                                  envs, network, protect, limits, run_image_cmd,
                                  disks)
        return await _abake(shared_async_client(url), ("POST", "/templates"), on_progress,
                            json=spec)

    @staticmethod
    async def bake(name: str, *, on_progress: Optional[ProgressCallback] = None,
                   url: Optional[str] = None) -> TemplateInfo:
        return await _abake(shared_async_client(url), ("POST", _api.bake_path(name)),
                            on_progress)

    @staticmethod
    async def list(url: Optional[str] = None) -> List[TemplateInfo]:
        return await _ado(shared_async_client(url), _api.list_templates())

    @staticmethod
    async def get(name: str, url: Optional[str] = None) -> TemplateInfo:
        return await _ado(shared_async_client(url), _api.get_template(name))

    @staticmethod
    async def save(name: str, url: Optional[str] = None) -> TemplateInfo:
        """As `Template.save`."""
        return await _ado(shared_async_client(url), _api.save_template(name))

    @staticmethod
    async def push(name: str, reference: str, *, plain_http: bool = False,
                   username: Optional[str] = None, password: Optional[str] = None,
                   on_progress: Optional[ProgressCallback] = None,
                   url: Optional[str] = None) -> PushResult:
        """As `Template.push`."""
        body = _api.registry_body(reference, plain_http, username, password)
        return await shared_async_client(url).follow_ndjson(
            "POST", _api.push_path(name), _api.RegistryStream(on_progress), json=body)

    @staticmethod
    async def pull(reference: str, *, name: Optional[str] = None, plain_http: bool = False,
                   username: Optional[str] = None, password: Optional[str] = None,
                   on_progress: Optional[ProgressCallback] = None,
                   url: Optional[str] = None) -> TemplateInfo:
        """As `Template.pull`."""
        body = _api.registry_body(reference, plain_http, username, password)
        path = _api.pull_path(name or _api.pulled_name(reference))
        return await shared_async_client(url).follow_ndjson(
            "POST", path, _api.RegistryStream(on_progress), json=body)

    @staticmethod
    async def delete(name: str, url: Optional[str] = None) -> None:
        await _ado(shared_async_client(url), _api.delete_template(name))
