"""forkbox.rollouts against a real forkboxd."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import List

from forkbox import AsyncSandbox, ForkboxError, Sandbox, rollouts


def test_group_of_4_collects_results_and_errors_in_order_and_kills_all(daemon_url: str) -> None:
    seen: List[Sandbox] = []
    lock = threading.Lock()

    def fn(sb: Sandbox) -> str:
        with lock:
            seen.append(sb)
        out = sb.commands.run("cat /tmp/seed").stdout.strip()
        sb.commands.run("echo mine > /tmp/seed")
        if sb is seen[0]:
            raise ValueError("this one fails")
        return out

    with Sandbox.create("minimal", timeout=600) as parent:
        parent.files.write("/tmp/seed", "shared\n")
        results = rollouts.group(parent, 4, fn, timeout=300)
        assert parent.is_running(), "a given sandbox is left running"
        assert parent.files.read("/tmp/seed") == "shared\n"
    assert len(results) == 4
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    assert [r for r in results if not isinstance(r, BaseException)] == ["shared"] * 3
    assert len(seen) == 4
    assert not any(sb.is_running() for sb in seen)


def test_group_from_template_times_out_and_still_kills(daemon_url: str) -> None:
    seen: List[Sandbox] = []
    returned = threading.Event()
    ended: "queue.Queue[object]" = queue.Queue()

    def fn(sb: Sandbox) -> int:
        seen.append(sb)
        try:
            # Outlives the group's 1 s; ends by itself (8 s) if the kill does
            # not cut it off, so that `fn` goes on.
            sb.commands.run("sleep 8")
            # `group` killed every child before it returned: from then on,
            # calls to the sandbox fail.
            if not returned.wait(120):
                ended.put("the group had not returned after 120 s")
                return 1
            sb.commands.run("true")
        except ForkboxError as e:
            ended.put(e)
            raise
        ended.put("the killed sandbox ran a command")
        return 0

    results = rollouts.group("minimal", 2, fn, timeout=1, metadata={"suite": "rollout-tmo"})
    returned.set()
    assert len(results) == 2
    assert all(isinstance(r, TimeoutError) for r in results), results
    assert Sandbox.list(metadata={"suite": "rollout-tmo"}) == []
    # Each child's `fn` ran (each puts exactly one entry), and each ended on
    # a call to its killed sandbox: the command cut off by the kill, or the
    # next call after it. The caller's doing, not the machinery's.
    late = [ended.get(timeout=120) for _ in range(2)]
    assert len(seen) == 2
    assert not any(sb.is_running() for sb in seen)
    assert all(isinstance(r, ForkboxError) and not r.infrastructure for r in late), late


def test_agroup_runs_coroutines_in_forks(daemon_url: str) -> None:
    async def fn(sb: AsyncSandbox) -> str:
        return (await sb.commands.run("echo $((6 * 7))")).stdout

    results = asyncio.run(rollouts.agroup("minimal", 2, fn, timeout=300))
    assert results == ["42\n", "42\n"]
