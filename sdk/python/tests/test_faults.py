"""Faults a guest causes itself: each is reported as the guest's (never
as an infrastructure failure), its sandbox is usable again or can be
killed, and a bystander sandbox is not affected."""

from __future__ import annotations

import os
import signal
import time
from typing import Iterator

import pytest

from forkbox import ForkboxError, GuestEndedError, Sandbox, TooLargeError


@pytest.fixture(scope="module")
def bystander(daemon_url: str) -> Iterator[Sandbox]:
    with Sandbox.create("minimal", timeout=600, metadata={"suite": "faults"}) as s:
        s.files.write("/tmp/mark", "untouched")
        yield s


def _unaffected(bystander: Sandbox) -> None:
    r = bystander.commands.run("cat /tmp/mark")
    assert (r.exit_code, r.stdout) == (0, "untouched")


POLICY_CGROUP = "/sys/fs/cgroup/forkbox-policy"
POLICY_PIDS = 1024  # the agent's bound on the policy's tasks (agent/src/cgroup.rs)


def _policy_event(sb: Sandbox, file: str, key: str) -> int:
    """A counter of the policy's cgroup (`pids.events`' `max`, say)."""
    text = sb.files.read(f"{POLICY_CGROUP}/{file}", user="root")
    return int(dict(line.split() for line in text.splitlines())[key])


def test_guest_out_of_memory_is_the_commands_own(bystander: Sandbox) -> None:
    with Sandbox.create("minimal", timeout=600) as sb:
        # A string that doubles until the policy's memory (the guest's 512
        # MiB less a reserve) runs out: its cgroup's OOM kill ends the
        # command, not the guest's.
        r = sb.commands.run("awk 'BEGIN { s = \"x\"; while (1) s = s s }'", timeout=300)
        assert not r.timed_out
        assert r.signal == 9 or (r.exit_code or 0) != 0, r
        assert _policy_event(sb, "memory.events", "oom_kill") >= 1
        assert sb.commands.run("echo alive").stdout == "alive\n"
        _unaffected(bystander)


def test_guest_disk_full_is_the_commands_own(bystander: Sandbox) -> None:
    with Sandbox.create("minimal", timeout=600) as sb:
        r = sb.commands.run("dd if=/dev/zero of=/tmp/fill bs=1M", timeout=300)
        assert r.exit_code == 1, r
        assert "No space left on device" in r.stderr
        assert sb.commands.run("rm /tmp/fill && echo freed").stdout == "freed\n"
        _unaffected(bystander)


def _cgroup(sb: Sandbox) -> str:
    """The cgroup a command of the policy user's runs in."""
    r = sb.commands.run("cat /proc/self/cgroup", timeout=120)
    assert r.exit_code == 0, r
    return r.stdout.strip()


def test_a_commands_cgroup_is_reused_only_once_it_is_empty(bystander: Sandbox) -> None:
    """The agent keeps an emptied command cgroup for the next command (a
    fork child then makes none); one a command left a process in is never
    handed to another, and a reused one still ends all of its command."""
    with Sandbox.create("minimal", timeout=600) as sb:
        first = _cgroup(sb)
        assert first.startswith("0::/forkbox-policy/exec-"), first
        assert _cgroup(sb) == first, "an empty cgroup is the next command's"
        kids = sb.fork(count=1)
        try:
            child = kids[0]
            assert isinstance(child, Sandbox), child
            assert _cgroup(child) == first, "a fork child reuses its parent's spare"
        finally:
            for k in kids:
                if isinstance(k, Sandbox):
                    k.kill()
        # A command that leaves a process behind keeps its cgroup to it.
        r = sb.commands.run("sleep 300 >/dev/null 2>&1 & cat /proc/self/cgroup", timeout=120)
        assert r.stdout.strip() == first, r
        after = _cgroup(sb)
        assert after != first, "a cgroup with a leftover process is no one else's"
        # The reused cgroup of a timed-out command is ended whole.
        r = sb.commands.run("sleep 600 & sleep 600 & wait", timeout=2)
        assert r.timed_out, r
        left = sb.commands.run(f"cat /sys/fs/cgroup{after[3:]}/cgroup.procs 2>/dev/null | wc -l",
                               user="root", timeout=120)
        assert left.stdout.strip() == "0", left
    _unaffected(bystander)


def _policy_tasks(sb: Sandbox) -> int:
    """The policy's tasks now, asked by a command of root's."""
    r = sb.commands.run(f"cat {POLICY_CGROUP}/pids.current", user="root", timeout=120)
    assert r.exit_code == 0, r
    return int(r.stdout)


def test_policy_fork_bomb_is_confined_and_the_sandbox_still_grades(bystander: Sandbox) -> None:
    with Sandbox.create("minimal", timeout=600) as sb:
        # At the timeout, cgroup.kill ends everything the command started:
        # what left its process group (setsid) too, however fast it forks.
        r = sb.commands.run("setsid sleep 1000 & f() { f | f & }; f; sleep 600", timeout=15)
        assert r.timed_out, r
        deadline = time.monotonic() + 30
        while _policy_tasks(sb) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _policy_tasks(sb) == 0
        assert sb.commands.run("echo alive").stdout == "alive\n"
        # One left running in the background, past its command: its tasks
        # stop at the policy's bound, and root's commands (the grader's)
        # keep answering meanwhile.
        sb.commands.run("f() { f | f & }; f", background=True)
        seen = [0]
        # In the emulated host the bomb grows slowly: 959 tasks in 240 s once
        # (2026-12-05), with a second emulated host beside it.
        deadline = time.monotonic() + 420
        while seen[-1] < 1000 and time.monotonic() < deadline:
            seen.append(_policy_tasks(sb))
        assert 1000 <= seen[-1] and max(seen) <= POLICY_PIDS, seen
        r = sb.commands.run("echo graded", user="root", timeout=120)
        assert (r.exit_code, r.stdout) == (0, "graded\n"), r
        _unaffected(bystander)
    _unaffected(bystander)


# A panic, a power-off and a reboot each end the VM; the VMM's note says
# which, and the daemon reports it as the guest's own.
@pytest.mark.parametrize("how,cmd,words", [
    ("panic", "echo c > /proc/sysrq-trigger", "panicked"),
    ("poweroff", "poweroff -f", "powered off"),
    ("reboot", "reboot -f", "guest reset ("),
])
def test_guest_that_ends_its_own_vm_is_its_own_failure(bystander: Sandbox, how: str, cmd: str,
                                                       words: str) -> None:
    sb = Sandbox.create("minimal", timeout=600)
    try:
        try:
            r = sb.commands.run(cmd, timeout=120, user="root")
            # The command may answer before the VM ends; the next call meets
            # the end.
            r = sb.commands.run("true", timeout=120)
            pytest.fail(f"{how}: the sandbox still answers: {r}")
        except GuestEndedError as e:
            assert not e.infrastructure, e
            assert e.kind == "guest_ended" and e.status == 410, e
            assert words in str(e), e
        death = sb.get_info().get("death")
        assert isinstance(death, dict) and words in death["guest_ended"]["reason"], death
        # Every later call says the same.
        with pytest.raises(GuestEndedError):
            sb.files.read("/etc/hostname")
        _unaffected(bystander)
    finally:
        sb.kill()


def test_vmm_killed_from_outside_is_infrastructure_and_harms_no_bystander(bystander: Sandbox) -> None:
    """A VMM that dies of a host's SIGKILL: the next call is a 502 the
    infrastructure owns, the sandbox is dead as `vm_lost`, the bystander
    answers as before."""
    sb = Sandbox.create("minimal", timeout=600)
    try:
        assert sb.commands.run("echo up").stdout == "up\n"
        os.kill(int(sb.get_info()["metrics"]["vmm_pid"]), signal.SIGKILL)
        with pytest.raises(ForkboxError) as caught:
            sb.commands.run("true", timeout=60)
        e = caught.value
        assert e.infrastructure and e.status == 502, e
        assert not isinstance(e, GuestEndedError), e
        assert "died" in str(e), e
        # Recorded with the answer, not a reaper round later.
        death = sb.get_info().get("death")
        assert isinstance(death, dict) and "vm_lost" in death, death
        _unaffected(bystander)
    finally:
        sb.kill()


def test_output_floods_are_cut_and_harm_no_bystander(bystander: Sandbox) -> None:
    """A command that floods its stdout (64 MiB) is cut at the output cap
    (16 MiB kept); one that writes to the console (the serial log) ends as
    commands do; the sandbox and the bystander answer after both."""
    with Sandbox.create("minimal", timeout=600) as sb:
        r = sb.commands.run("head -c 67108864 /dev/zero | tr '\\0' x", timeout=300)
        assert r.exit_code == 0, r
        # The daemon keeps at most 16 MiB of a buffered command's stdout.
        assert len(r.stdout) == 16 << 20 and set(r.stdout) == {"x"}, len(r.stdout)
        # Every console byte is a VM exit: 256 KiB, not the 8 MiB the
        # serial log holds (a unit test holds that cap).
        r = sb.commands.run("head -c 262144 /dev/zero | tr '\\0' y > /dev/console; echo done",
                            timeout=300, user="root")
        assert (r.exit_code, r.stdout) == (0, "done\n"), r
        assert sb.commands.run("echo alive").stdout == "alive\n"
        _unaffected(bystander)


def test_endless_file_read_is_too_large_and_harms_no_bystander(bystander: Sandbox) -> None:
    """Reading a file that never ends (`/dev/zero`) stops at `max_bytes`
    and is a `TooLargeError`, the guest's doing, never an infrastructure
    failure: under a MiB before the answer starts (413), over it
    mid-stream (the framed download's last frame says why). The sandbox
    and the bystander answer after."""
    with Sandbox.create("minimal", timeout=600) as sb:
        for limit in (1 << 20, 3 << 20):
            with pytest.raises(TooLargeError) as caught:
                sb.files.read("/dev/zero", format="bytes", max_bytes=limit, user="root")
            assert not caught.value.infrastructure, caught.value
            assert str(limit) in str(caught.value), caught.value
        assert sb.commands.run("echo alive").stdout == "alive\n"
        _unaffected(bystander)
