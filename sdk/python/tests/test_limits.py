"""A sandbox held to less than its shape gets: its template's limits and
its own, in force on the host (its VMM's cgroup), shown in its info; more
than its shape gets is refused; a guest that writes past its memory limit
is ended, and that is its own doing, never an infrastructure failure."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Dict

import pytest

from forkbox import (CapacityError, GuestEndedError, InvalidRequestError, NotFoundError, Sandbox,
                     Template)

from conftest import _forkboxd


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _cgroup(sb: Sandbox) -> Path:
    """The host cgroup of the sandbox's VMM (this test runs beside the
    daemon, on its host)."""
    pid = sb.get_info()["metrics"]["vmm_pid"]
    line = Path(f"/proc/{pid}/cgroup").read_text().strip()
    return Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")


def _cpu_stat(cgroup: Path) -> Dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in
                                   (cgroup / "cpu.stat").read_text().splitlines())}


def test_limits_of_a_template_and_of_a_creation_hold_on_the_host(daemon_url: str) -> None:
    # The shape's own by default: `minimal` is 1 vCPU and 512 MiB.
    with Sandbox.create("minimal", timeout=600) as sb:
        metrics = sb.get_info()["metrics"]
        assert metrics["limits"] == {"cpus": 2.0, "memory_mib": 1024}, metrics
        assert metrics["memory_charged_kib"] > 0, metrics
    name = _name("held")
    info = Template.build(name, limits={"cpus": 0.5, "memory_mib": 256})
    try:
        assert info.limits == {"cpus": 0.5, "memory_mib": 256}
        with Sandbox.create(name, timeout=600) as sb:
            assert sb.get_info()["metrics"]["limits"] == {"cpus": 0.5, "memory_mib": 256}
            cgroup = _cgroup(sb)
            assert (cgroup / "cpu.max").read_text().split() == ["50000", "100000"]
            assert (cgroup / "memory.max").read_text().strip() == str(256 << 20)
        # A creation's own, field by field over the template's; a guest
        # busy past its CPU time is throttled, not ended.
        with Sandbox.create(name, timeout=600, limits={"cpus": 0.1}) as sb:
            assert sb.get_info()["metrics"]["limits"] == {"cpus": 0.1, "memory_mib": 256}
            cgroup = _cgroup(sb)
            before = _cpu_stat(cgroup)["nr_throttled"]
            r = sb.commands.run("timeout 3 sh -c 'while :; do :; done'; echo done", timeout=300)
            assert r.stdout == "done\n", r
            assert _cpu_stat(cgroup)["nr_throttled"] > before
        # More than its shape gets: refused, and nothing is made.
        live = len(Sandbox.list())
        with pytest.raises(InvalidRequestError, match="limits.cpus 3"):
            Sandbox.create(name, limits={"cpus": 3})
        with pytest.raises(InvalidRequestError, match="limits.memory_mib 20"):
            Sandbox.create(name, limits={"memory_mib": 20})
        assert len(Sandbox.list()) == live
        with pytest.raises(InvalidRequestError, match="limits.memory_mib 4096"):
            Template.build(_name("greedy"), limits={"memory_mib": 4096})
    finally:
        try:
            Template.delete(name)
        except NotFoundError:
            pass


def test_guest_writing_past_its_memory_limit_is_ended_as_its_own_doing(daemon_url: str) -> None:
    sb = Sandbox.create("minimal", timeout=600, limits={"memory_mib": 96})
    try:
        # 200 MiB into the guest's /tmp (a tmpfs of half its 512 MiB): the
        # guest may, but its sandbox holds 96 MiB of host memory.
        with pytest.raises(GuestEndedError) as ei:
            sb.commands.run("dd if=/dev/zero of=/tmp/fill bs=1M count=200", timeout=300)
            # The command may answer before the VM ends; the next call
            # meets the end.
            sb.commands.run("true", timeout=120)
        e = ei.value
        assert not e.infrastructure, e
        assert "memory limit" in str(e), e
        death = sb.get_info().get("death")
        assert isinstance(death, dict) and "96 MiB" in death["guest_ended"]["reason"], death
    finally:
        sb.kill()


def test_creation_that_would_eat_the_hosts_memory_reserve_is_refused_saying_so() -> None:
    # A daemon that keeps a pebibyte free: no host has room for one more.
    with _forkboxd(4, extra=["--memory-reserve-mib", str(1 << 30)]) as url:
        with pytest.raises(CapacityError, match="host memory") as ei:
            Sandbox.create("minimal", url=url)
        assert not ei.value.infrastructure
        assert "--memory-reserve-mib" in str(ei.value)
        assert Sandbox.list(url=url) == []
