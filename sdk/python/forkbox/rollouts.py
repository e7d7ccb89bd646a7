"""Groups of rollouts from one state: fork `n` sandboxes, run a function
in each at once, collect what each returned or raised, kill them all.

    from forkbox import rollouts
    results = rollouts.group("my-task", 8, lambda sb: sb.commands.run("./attempt").exit_code,
                             timeout=120)
    scores = [r for r in results if not isinstance(r, BaseException)]

The answer is a list with one entry per child, in fork order: what
`fn(child)` returned, or the exception instance it raised (not raised
again), or the `ForkboxError` that child's fork met (then `fn` did not run
for it), or a `TimeoutError` when the group's time ran out before `fn`
finished. Entries that are `ForkboxError`s with `.infrastructure` set are
the machinery's fault: mask those rather than scoring them. A
`GuestEndedError` (the child's guest powered off, rebooted or panicked)
is the policy's own failure: score it. So is a `TamperedError`: the
child's template protects paths (`Template.build(protect=...)`) and they
had changed by the time `fn` returned, so its result is withheld
(`check_integrity=False` skips the check).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import (Any, Awaitable, Callable, Dict, List, Mapping, Optional, TypeVar, Union,
                    cast)

from .async_sandbox import AsyncSandbox
from .exceptions import ForkboxError, TamperedError
from .sandbox import Sandbox

T = TypeVar("T")
Outcome = Union[T, BaseException]


def _timed_out(timeout: Optional[float]) -> TimeoutError:
    return TimeoutError(f"the rollout group's time limit ({timeout} s) ran out first")


def group(source: Union[str, Sandbox], n: int, fn: Callable[[Sandbox], T], *,
          timeout: Optional[float] = None, metadata: Optional[Mapping[str, str]] = None,
          sandbox_timeout: Optional[float] = 3600, network: Optional[Mapping[str, Any]] = None,
          check_integrity: bool = True, url: Optional[str] = None) -> List[Outcome[T]]:
    """Forks `n` (at most 1024) sandboxes from one state and runs
    `fn(child)` in each, each in its own thread, started as soon as that
    child is up (the fork streams its children: the first rollouts of a
    wide group run while the last children are still coming).

    `source`: a template name (one sandbox is created from it and forked
    `n` ways; it is killed at the end too) or a running `Sandbox` (forked
    as it is now; left running). `timeout`: seconds for all the `fn`s
    together, counted once every child exists; `None` waits for all.
    `metadata`, `sandbox_timeout` (a time-to-live, the safety net if
    this process dies) and `network` (its egress policy, which every child
    inherits; default: nothing reachable) apply to the sandbox created from
    a template.

    Every child is killed before this returns, on error or time-out too;
    a `fn` still running then sees its next calls to its sandbox fail (a
    command already running may not be cut off). Raises only
    when the group could not start (create or the fork request failed)."""
    parent: Sandbox
    if isinstance(source, str):
        parent = Sandbox.create(source, timeout=sandbox_timeout, metadata=metadata,
                                network=network, url=url)
        owned = True
    else:
        parent, owned = source, False
    runs = _Threads(fn, check_integrity)
    try:
        # Each child's `fn` starts as soon as that child is up.
        children = parent.fork(count=n, on_child=runs.start)
        return runs.results(children, timeout)
    finally:
        _kill_all(runs.sandboxes() + ([parent] if owned else []))


class _Threads:
    """One thread per child running `fn`, each started as its child comes
    up, and their results."""

    def __init__(self, fn: Callable[[Sandbox], T], check_integrity: bool) -> None:
        self._fn = fn
        self._check = check_integrity
        self._cond = threading.Condition()
        self._results: Dict[int, Outcome[T]] = {}
        self._started: Dict[int, Sandbox] = {}

    def start(self, i: int, child: Union[Sandbox, ForkboxError]) -> None:
        if not isinstance(child, Sandbox):
            return
        self._started[i] = child
        # Daemon threads: a `fn` that ignores its killed sandbox must not
        # keep the process alive.
        threading.Thread(target=self._work, args=(i, child), daemon=True,
                         name=f"forkbox-rollout-{i}").start()

    def sandboxes(self) -> List[Sandbox]:
        return list(self._started.values())

    def _work(self, i: int, sb: Sandbox) -> None:
        try:
            r: Outcome[T] = self._fn(sb)
            if self._check:
                report = sb.integrity.check()
                if not report:
                    r = TamperedError(report)
        except Exception as e:  # noqa: BLE001 - every failure is a result here
            r = e
        with self._cond:
            self._results[i] = r
            self._cond.notify_all()

    def results(self, children: List[Union[Sandbox, ForkboxError]],
                timeout: Optional[float]) -> List[Outcome[T]]:
        """Waits up to `timeout` (from now: every child exists) for every
        started `fn`; one entry per child, in order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._results) < len(self._started):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            out: List[Outcome[T]] = []
            for i, c in enumerate(children):
                if isinstance(c, ForkboxError):
                    out.append(c)
                else:
                    out.append(self._results.get(i, _timed_out(timeout)))
        return out


def _kill_all(sandboxes: List[Sandbox]) -> None:
    """Kills them all at once; a failed kill does not stop the others."""
    def kill(sb: Sandbox) -> None:
        try:
            sb.kill()
        except ForkboxError:
            pass
    threads = [threading.Thread(target=kill, args=(sb,), daemon=True) for sb in sandboxes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


async def agroup(source: Union[str, AsyncSandbox], n: int,
                 fn: Callable[[AsyncSandbox], Awaitable[T]], *, timeout: Optional[float] = None,
                 metadata: Optional[Mapping[str, str]] = None,
                 sandbox_timeout: Optional[float] = 3600,
                 network: Optional[Mapping[str, Any]] = None,
                 check_integrity: bool = True,
                 url: Optional[str] = None) -> List[Outcome[T]]:
    """`group` for asyncio: `fn` is a coroutine function, run as one task
    per child; tasks still running at the time limit are cancelled."""

    async def checked(sb: AsyncSandbox) -> T:
        r = await fn(sb)
        if check_integrity:
            report = await sb.integrity.check()
            if not report:
                raise TamperedError(report)
        return r

    parent: AsyncSandbox
    if isinstance(source, str):
        parent = await AsyncSandbox.create(source, timeout=sandbox_timeout, metadata=metadata,
                                           network=network, url=url)
        owned = True
    else:
        parent, owned = source, False
    children: List[Union[AsyncSandbox, ForkboxError]] = []
    tasks: Dict[int, "asyncio.Future[T]"] = {}
    started: List[AsyncSandbox] = []

    def start(i: int, child: Union[AsyncSandbox, ForkboxError]) -> None:
        # Each child's `fn` starts as soon as that child is up.
        if isinstance(child, AsyncSandbox):
            started.append(child)
            tasks[i] = asyncio.ensure_future(checked(child))

    try:
        children = await parent.fork(count=n, on_child=start)
        if tasks:
            await asyncio.wait(list(tasks.values()), timeout=timeout)
        out: List[Outcome[T]] = []
        for i, c in enumerate(children):
            t = tasks.get(i)
            if t is None:
                out.append(cast(ForkboxError, c))
            elif not t.done():
                t.cancel()
                out.append(_timed_out(timeout))
            elif t.cancelled():
                out.append(asyncio.CancelledError())
            else:
                e = t.exception()
                out.append(e if e is not None else t.result())
        return out
    finally:
        for t in tasks.values():
            t.cancel()
        doomed: List[Any] = list(started)
        if owned:
            doomed.append(parent)
        await asyncio.gather(*(sb.kill() for sb in doomed), return_exceptions=True)
