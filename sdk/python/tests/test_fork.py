"""Fork, pause/resume and snapshots against a real forkboxd."""

from __future__ import annotations

import uuid
from typing import Dict, List, Sequence

import pytest

from forkbox import ForkboxError, Sandbox, Template


def _alive(children: Sequence[object]) -> List[Sandbox]:
    return [c for c in children if isinstance(c, Sandbox)]


def test_fork_16_children_start_from_the_parents_state_in_order(daemon_url: str) -> None:
    with Sandbox.create("minimal", timeout=600, metadata={"suite": "fork"}) as parent:
        parent.files.write("/tmp/state", "before fork")
        parent.commands.run("echo 42 > /tmp/counter")
        children = parent.fork(count=16)
        try:
            assert len(children) == 16
            errors = [c for c in children if not isinstance(c, Sandbox)]
            assert errors == [], errors
            kids = _alive(children)
            assert len({k.sandbox_id for k in kids}) == 16
            assert parent.sandbox_id not in {k.sandbox_id for k in kids}
            for i, k in enumerate(kids):
                # Each child sees the parent's files and gets its own copy.
                r = k.commands.run(f"cat /tmp/state; read n < /tmp/counter; "
                                   f"echo $((n + {i})) > /tmp/counter; cat /tmp/counter")
                assert r.stdout == f"before fork{42 + i}\n", r
            assert parent.files.read("/tmp/counter") == "42\n", "children's writes stay theirs"
            info = kids[3].get_info()
            assert info["parent"] == parent.sandbox_id
            assert info["state"] == "running"
            assert set(parent.get_info()["children"]) >= {k.sandbox_id for k in kids}
        finally:
            for k in _alive(children):
                k.kill()
        assert not any(k.is_running() for k in _alive(children))


def test_fork_count_out_of_range_is_refused_before_sending() -> None:
    sb = Sandbox({"id": "sb-0000000000000000"}, None)  # type: ignore[arg-type]
    for bad in (0, 1025):
        with pytest.raises(ValueError):
            sb.fork(count=bad)
        with pytest.raises(ValueError):
            sb.fork(count=bad, on_child=lambda i, c: None)


def test_a_streamed_fork_gives_each_child_as_it_comes_up_and_the_same_list(daemon_url: str) -> None:
    given: Dict[int, object] = {}
    answers: Dict[int, str] = {}

    def on_child(i: int, child: object) -> None:
        assert i not in given, f"child {i} given twice"
        given[i] = child
        # A child given is up: it answers at once, before the others are.
        if isinstance(child, Sandbox):
            answers[i] = child.commands.run("cat /tmp/state").stdout

    with Sandbox.create("minimal", timeout=600) as parent:
        parent.files.write("/tmp/state", "streamed")
        children = parent.fork(count=8, on_child=on_child)
        try:
            assert sorted(given) == list(range(8))
            assert all(given[i] is c for i, c in enumerate(children)), "the list is what was given"
            assert [c for c in children if not isinstance(c, Sandbox)] == []
            assert answers == {i: "streamed" for i in range(8)}
            assert len({c.sandbox_id for c in _alive(children)}) == 8
        finally:
            for k in _alive(children):
                k.kill()


def test_pause_then_resume_keeps_state(daemon_url: str) -> None:
    with Sandbox.create("minimal", timeout=600) as sb:
        sb.commands.run("echo kept > /tmp/mark")
        sb.pause()
        assert sb.get_info()["state"] == "paused"
        sb.resume()
        assert sb.get_info()["state"] == "running"
        assert sb.commands.run("cat /tmp/mark").stdout == "kept\n"


def test_create_snapshot_makes_a_template_that_forks_that_state(daemon_url: str) -> None:
    name = f"snap-{uuid.uuid4().hex[:8]}"
    try:
        with Sandbox.create("minimal", timeout=600) as sb:
            sb.commands.run("echo snapshotted > /tmp/mark")
            tmpl = sb.create_snapshot(name)
            assert tmpl.name == name
            assert tmpl.from_sandbox == sb.sandbox_id
            assert tmpl.state == "ready"
            # The source keeps running; changes after the snapshot are its own.
            sb.commands.run("echo later > /tmp/mark")
        assert name in [t.name for t in Template.list()]
        with Sandbox.create(name, timeout=600) as again:
            assert again.commands.run("cat /tmp/mark").stdout == "snapshotted\n"
            assert again.template == name
        Template.delete(name)
        assert name not in [t.name for t in Template.list()]
    finally:
        try:
            Template.delete(name)
        except ForkboxError:
            pass


def test_seeded_forks_repeat_their_childrens_seeds_and_siblings_differ(daemon_url: str) -> None:
    def seeds(sandboxes: Sequence[Sandbox]) -> List[str]:
        out = []
        for s in sandboxes:
            r = s.commands.run("echo \"${FORKBOX_SEED-none}\"; cat /run/forkbox/seed || echo none")
            env, file = r.stdout.split()
            assert env == file, r
            out.append(env)
        return out

    with Sandbox.create("minimal", timeout=600, metadata={"suite": "fork"}) as parent:
        groups = [parent.fork(3, seed=42), parent.fork(3, seed=42), parent.fork(1)]
        try:
            first, again, unseeded = (_alive(g) for g in groups)
            assert len(first) == len(again) == 3 and len(unseeded) == 1
            a, b = seeds(first), seeds(again)
            assert a == b, (a, b)
            assert len(set(a)) == 3 and "none" not in a, a
            assert seeds(unseeded) == ["none"]
        finally:
            for g in groups:
                for c in _alive(g):
                    c.kill()
    made = [Sandbox.create("minimal", timeout=300, seed=s) for s in (7, 7, 8)]
    try:
        x, y, z = seeds(made)
        assert x == y != z, (x, y, z)
    finally:
        for s in made:
            s.kill()
    with pytest.raises(ValueError):
        Sandbox.create("minimal", seed=-1)
