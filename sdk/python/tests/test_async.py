"""AsyncSandbox against a real forkboxd (each test drives its own loop)."""

from __future__ import annotations

import asyncio
from typing import List

import pytest

from forkbox import AsyncSandbox, AsyncTemplate, NotFoundError


def test_async_create_run_files_fork_and_context_manager(daemon_url: str) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create("minimal", timeout=600,
                                             metadata={"suite": "async"}) as sb:
            r = await sb.commands.run("echo hi; echo err >&2; exit 4")
            assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 4)
            out: List[str] = []
            r = await sb.commands.run("echo one; echo two", on_stdout=out.append)
            assert "".join(out) == "one\ntwo\n" and r.exit_code == 0
            assert await sb.files.write("/tmp/a/b.txt", "async") == 5
            assert await sb.files.read("/tmp/a/b.txt") == "async"
            assert [e.name for e in await sb.files.list("/tmp/a")] == ["b.txt"]
            assert await sb.files.exists("/tmp/a/b.txt")
            with pytest.raises(NotFoundError):
                await sb.files.read("/tmp/nope")
            listed = await AsyncSandbox.list(metadata={"suite": "async"})
            assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
            kids = await sb.fork(count=2)
            assert all(isinstance(k, AsyncSandbox) for k in kids), kids
            try:
                outs = await asyncio.gather(*(k.files.read("/tmp/a/b.txt") for k in kids
                                              if isinstance(k, AsyncSandbox)))
                assert outs == ["async", "async"]
            finally:
                await asyncio.gather(*(k.kill() for k in kids if isinstance(k, AsyncSandbox)))
            assert not await kids[0].is_running()  # type: ignore[union-attr]
        assert not await sb.is_running()
        assert "minimal" in [t.name for t in await AsyncTemplate.list()]
    asyncio.run(main())
