"""This suite as one shard of `forkbox testbed run --shards N`, resumable
after its emulated host crashed or wedged.

The other side of this protocol is crates/host/src/testbed/suite.rs: the
test bed runs the suite in N one-CPU emulated hosts side by side and tells
each its share in FORKBOX_TESTBED_SHARD (`i/n`) and its ledger file in
FORKBOX_TESTBED_LEDGER. Modules are split whole (their fixtures stay
together), the longest first, each to the shard with the least time so far.
Every test appends `started NAME` and then `ok NAME` or `FAILED NAME
MESSAGE` to the ledger; a new emulated host that runs the shard again leaves
out the tests that passed and fails again the ones that failed, with their
message. Outside the test bed neither variable is set and the whole suite
runs as usual.
"""

from __future__ import annotations

import os
import sys
import urllib.parse
from typing import Dict, List, Optional, Set

import pytest

SHARD_ENV = "FORKBOX_TESTBED_SHARD"
LEDGER_ENV = "FORKBOX_TESTBED_LEDGER"

# Seconds each module took in a one-CPU emulated host (2026-12-05, this
# project's 2-core machine; pytest --durations), for spreading the long ones
# over the shards; a module not listed counts DEFAULT_SECONDS.
MODULE_SECONDS: Dict[str, int] = {
    "tests/test_reward_hacks.py": 420,
    "tests/test_docker.py": 300,
    "tests/test_disks.py": 75,
    "tests/test_faults.py": 240,
    "tests/test_daemon_lifecycle.py": 148,
    "tests/test_cli.py": 121,
    "tests/test_integrity.py": 105,
    "tests/test_network.py": 101,
    "tests/test_fork.py": 94,
    "tests/test_sandbox.py": 86,
    "tests/test_gym.py": 79,
    "tests/test_template.py": 66,
    "tests/test_limits.py": 130,
    "tests/test_replay.py": 30,
    "tests/test_rollouts.py": 16,
    "tests/test_ports_processes.py": 15,
    "tests/test_dirs.py": 5,
    "tests/test_async.py": 4,
    "tests/test_tar_unpack.py": 1,
}
DEFAULT_SECONDS = 60


def split(modules: List[str], shard: int, shards: int) -> Set[str]:
    """The modules of shard `shard` of `shards` (1-based). Every shard
    computes the same split, so each module runs in exactly one."""
    order = sorted(sorted(modules), key=lambda m: -MODULE_SECONDS.get(m, DEFAULT_SECONDS))
    load = [0] * shards
    mine = set()
    for m in order:
        s = min(range(shards), key=lambda k: (load[k], k))
        load[s] += MODULE_SECONDS.get(m, DEFAULT_SECONDS)
        if s == shard - 1:
            mine.add(m)
    return mine


def ledger_name(nodeid: str) -> str:
    """A test's name in the ledger, which has no blanks."""
    return urllib.parse.quote(nodeid, safe="/:[]-_.,=")


class Ledger:
    """The file where this shard's tests record how they started and
    ended, one whole line each (a crash leaves whole lines)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def ended(self) -> Dict[str, Optional[str]]:
        """Every test that ended so far: None if it passed, else how it
        failed."""
        out: Dict[str, Optional[str]] = {}
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            verdict, _, rest = line.partition(" ")
            name, _, msg = rest.partition(" ")
            if verdict == "ok":
                out[name] = None
            elif verdict == "FAILED":
                out[name] = msg.replace("\\n", "\n")
        return out

    def append(self, line: str) -> None:
        # One write of one whole line, to a file opened for appending.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)

    def start(self, nodeid: str) -> None:
        self.append(f"started {ledger_name(nodeid)}\n")

    def record(self, nodeid: str, failure: Optional[str]) -> None:
        if failure is None:
            self.append(f"ok {ledger_name(nodeid)}\n")
        else:
            self.append(f"FAILED {ledger_name(nodeid)} {failure.replace(chr(10), chr(92) + 'n')}\n")


class TestbedShard:
    """The pytest plugin: its share of the modules, what ended before left
    out or failed again, every test's start and end recorded."""

    def __init__(self, shard: Optional[str], ledger: Optional[str]) -> None:
        self.shard = None
        if shard:
            i, _, n = shard.partition("/")
            if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
                raise pytest.UsageError(f"{SHARD_ENV}={shard!r} is not i/n with 1 <= i <= n")
            self.shard = (int(i), int(n))
        self.ledger = Ledger(ledger) if ledger else None
        self.failures: Dict[str, str] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: List[pytest.Item]) -> None:
        keep, drop = list(items), []
        if self.shard:
            i, n = self.shard
            mine = split(sorted({it.nodeid.split("::")[0] for it in items}), i, n)
            keep = [it for it in items if it.nodeid.split("::")[0] in mine]
            drop = [it for it in items if it.nodeid.split("::")[0] not in mine]
            sys.stderr.write(f"testbed shard {i}/{n}: {len(mine)} modules, {len(keep)} tests: "
                             f"{', '.join(sorted(mine))}\n")
        if self.ledger:
            ended = self.ledger.ended()
            passed = [it for it in keep if ended.get(ledger_name(it.nodeid), "") is None]
            for it in keep:
                msg = ended.get(ledger_name(it.nodeid))
                if msg is not None:
                    it.runtest = _fails_again(msg)  # type: ignore[method-assign]
            if passed:
                sys.stderr.write(f"testbed: {len(passed)} tests passed in an earlier emulated host "
                                 "of this run and are not run again\n")
                keep = [it for it in keep if it not in passed]
                drop += passed
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        if self.ledger:
            self.ledger.start(nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            text = f"{report.when}: {report.longreprtext}"
            self.failures[report.nodeid] = (self.failures.get(report.nodeid, "") + text)[-4000:]

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        if self.ledger:
            self.ledger.record(nodeid, self.failures.pop(nodeid, None))


def _fails_again(msg: str):
    def runtest() -> None:
        pytest.fail("failed in an earlier emulated host of this run (which then crashed or "
                    f"wedged):\n{msg}", pytrace=False)
    return runtest


def register(config: pytest.Config) -> None:
    shard, ledger = os.environ.get(SHARD_ENV), os.environ.get(LEDGER_ENV)
    if shard or ledger:
        config.pluginmanager.register(TestbedShard(shard, ledger), "forkbox-testbed-shard")
