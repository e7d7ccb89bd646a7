"""Protected paths against a real forkboxd: a template protects its grader
and tests; the unprivileged policy cannot change them; whatever root
changes, the integrity check names; the gym env and rollout groups
withhold the reward of a rollout that changed them."""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Iterator

import pytest

from forkbox import (NotFoundError, Sandbox, TamperedError, Template, TemplateError,
                     rollouts)
from forkbox.gym import SandboxEnv

from test_cli import forkbox

# A task directory the policy's user owns (as a real task's would be),
# with a grader and tests in it that only root may change.
SETUP = [
    "mkdir -p /task/tests && chown user /task && chmod 777 /task",
    "printf '#!/bin/sh\\ntest -f /task/answer\\n' > /task/grade.sh && chmod 777 /task/grade.sh",
    "echo 'test \"$(cat /task/answer)\" = 42' > /task/tests/test_answer.sh",
    "chown -R user /task/tests",
]
PROTECT = ["/task/grade.sh", "/task/tests"]
# What a policy that became root could do: mount a grader that always
# passes over the real one, and tests of its own over the real ones.
ROOT_HACK = ("echo 'exit 0' > /tmp/grade.sh && mount --bind /tmp/grade.sh /task/grade.sh && "
             "mkdir /tmp/tests && touch /tmp/tests/conftest.sh && "
             "mount --bind /tmp/tests /task/tests")


@pytest.fixture(scope="module")
def task(daemon_url: str) -> Iterator[str]:
    name = f"task-{uuid.uuid4().hex[:8]}"
    info = Template.build(name, setup=SETUP, protect=PROTECT)
    assert info.protect == PROTECT
    yield name
    try:
        Template.delete(name)
    except NotFoundError:
        pass


def test_protected_paths_are_out_of_the_policys_hands_and_checked(task: str) -> None:
    with Sandbox.create(task, timeout=600) as sb:
        report = sb.integrity.check()
        assert report and report.intact, report
        assert report.protected == PROTECT
        assert report.entries == 3  # the grader, the tests directory, its test
        # The policy (the default user) owns /task, yet cannot edit,
        # replace, rename or remove what is protected in it.
        for hack in ["echo 'exit 0' > /task/grade.sh", "rm -f /task/grade.sh",
                     "mv /task/tests /task/old", "touch /task/tests/conftest.sh",
                     "echo true > /task/tests/test_answer.sh", "chmod 777 /task/grade.sh"]:
            r = sb.commands.run(hack)
            assert r.exit_code != 0, f"{hack!r} succeeded"
        assert sb.commands.run("echo 42 > /task/answer").exit_code == 0
        assert sb.integrity.check().intact
        # Root cannot write them either (they are immutable), but a policy
        # that became root could mount its own over them: the check names
        # what it sees instead.
        r = sb.commands.run("echo 'exit 0' > /task/grade.sh", user="root")
        assert r.exit_code != 0, "immutable, even to root"
        r = sb.commands.run(ROOT_HACK, user="root")
        assert r.exit_code == 0, r
        report = sb.integrity.check()
        assert not report
        assert "/task/grade.sh" in report.changed, report
        assert report.added == ["/task/tests/conftest.sh"]
        assert report.removed == ["/task/tests/test_answer.sh"]
        # A fork is compared with the template's record, not its parent's
        # state: the tampering shows in the child too.
        child = sb.fork(count=1)[0]
        assert isinstance(child, Sandbox), child
        with child:
            assert child.integrity.check().tampered == report.tampered
        # The CLI says the same, and exits 1.
        p = forkbox("sandbox", "integrity", sb.sandbox_id, "--json", check=False)
        assert p.returncode == 1, p.stderr
        assert json.loads(p.stdout)["changed"] == ["/task/grade.sh"]


def test_nothing_protected_is_intact_and_says_so(daemon_url: str) -> None:
    with Sandbox.create("minimal", timeout=600) as sb:
        report = sb.integrity.check()
        assert report.intact and report.protected == [] and report.entries == 0
        p = forkbox("sandbox", "integrity", sb.sandbox_id)
        assert "protects nothing" in p.stdout


def test_a_protected_path_setup_did_not_make_fails_the_bake(daemon_url: str) -> None:
    name = f"unprotectable-{uuid.uuid4().hex[:8]}"
    with pytest.raises(TemplateError) as ei:
        Template.build(name, setup=["mkdir -p /task"], protect=["/task/grader.py"])
    assert ei.value.step == "protect", ei.value.detail
    assert "/task/grader.py" in str(ei.value)
    assert not ei.value.infrastructure


def test_gym_env_withholds_the_reward_of_a_policy_that_edits_its_grader(task: str) -> None:
    env = SandboxEnv(task, grader="sh /task/grade.sh", max_steps=3, user="root")
    try:
        env.reset()
        obs, reward, terminated, truncated, info = env.step(ROOT_HACK)
        assert (reward, terminated, truncated) == (0.0, True, False), info
        assert "/task/grade.sh" in info["tampered"], info
        assert info["infrastructure"] is False
        # An honest episode is graded as usual.
        env.reset()
        _, reward, terminated, _, info = env.step("echo 42 > /task/answer")
        assert (reward, terminated) == (1.0, True), info
        assert "tampered" not in info
    finally:
        env.close()


def test_rollout_group_marks_the_child_that_tampered(task: str) -> None:
    calls = itertools.count()

    def attempt(sb: Sandbox) -> int:
        cheat = next(calls) == 0  # the first child to get here
        assert sb.commands.run("echo 42 > /task/answer").exit_code == 0
        if cheat:
            sb.commands.run("mkdir /tmp/none && mount --bind /tmp/none /task/tests", user="root")
        return sb.commands.run("sh /task/grade.sh").exit_code or 0

    with Sandbox.create(task, timeout=600) as parent:
        results = rollouts.group(parent, 2, attempt)
        assert sorted(type(r).__name__ for r in results) == ["TamperedError", "int"], results
        assert 0 in results
        t = next(r for r in results if isinstance(r, TamperedError))
        assert t.report.removed == ["/task/tests/test_answer.sh"], t.report
        assert not t.infrastructure
        # Unchecked, the same rollout's result stands.
        calls = itertools.count()
        assert rollouts.group(parent, 1, attempt, check_integrity=False) == [0]
