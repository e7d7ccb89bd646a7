"""Determinism you can check: run a scripted trajectory from one state with
one seed, twice (or more), and compare.

    from forkbox.replay import replay
    r = replay("my-task", ["python3 gen.py", "python3 solve.py"], seed=7)
    assert r.same, r.first_difference

Each run starts from the same state: a fresh sandbox of a template, or a
fork of a running sandbox, made with the same `seed` (so the same
after-fork entropy and `FORKBOX_SEED`). Each action's exit code, stdout and
stderr make a step; the steps' SHA-256 is the trajectory's hash. What a
guest reads from `/dev/urandom`, the clock or timing does not repeat: a
task that wants repeatable randomness seeds from `FORKBOX_SEED`, and
`first_difference` says where a trajectory stopped repeating.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

from .exceptions import ForkboxError
from .sandbox import Sandbox


@dataclass(frozen=True)
class Step:
    action: str
    exit_code: Optional[int]
    stdout: str
    stderr: str


@dataclass
class Trajectory:
    steps: List[Step]
    hash: str
    """SHA-256 (hex) of the steps, in order."""


@dataclass
class Replayed:
    """What `replay` found."""

    same: bool
    trajectories: List[Trajectory] = field(default_factory=list)
    first_difference: Optional[Tuple[int, str]] = None
    """The first step (0-based) at which a run differed from the first,
    and how; `None` when all runs are the same."""

    @property
    def hashes(self) -> List[str]:
        return [t.hash for t in self.trajectories]


def _hash(steps: Sequence[Step]) -> str:
    h = hashlib.sha256()
    for s in steps:
        h.update(json.dumps([s.action, s.exit_code, s.stdout, s.stderr]).encode())
        h.update(b"\n")
    return h.hexdigest()


def run_trajectory(source: Union[str, Sandbox], actions: Sequence[str], *, seed: int,
                   user: Optional[Union[str, int]] = None, timeout: Optional[float] = 60,
                   url: Optional[str] = None) -> Trajectory:
    """Runs `actions` (shell commands, in order) in a fresh sandbox of
    template `source`, or in a fork of sandbox `source`, made with `seed`;
    the sandbox is killed after."""
    if isinstance(source, str):
        sb = Sandbox.create(source, seed=seed, url=url)
    else:
        child = source.fork(count=1, seed=seed)[0]
        if isinstance(child, ForkboxError):
            raise child
        sb = child
    with sb:
        steps = []
        for action in actions:
            r = sb.commands.run(action, user=user, timeout=timeout)
            steps.append(Step(action, r.exit_code, r.stdout, r.stderr))
    return Trajectory(steps, _hash(steps))


def _difference(a: Trajectory, b: Trajectory) -> Tuple[int, str]:
    for i, (x, y) in enumerate(zip(a.steps, b.steps)):
        for what in ("exit_code", "stdout", "stderr"):
            if getattr(x, what) != getattr(y, what):
                return i, (f"step {i} ({x.action!r}): {what} {getattr(x, what)!r} "
                           f"then {getattr(y, what)!r}")
    return min(len(a.steps), len(b.steps)), "one run has more steps"


def replay(source: Union[str, Sandbox], actions: Sequence[str], *, seed: int, runs: int = 2,
           user: Optional[Union[str, int]] = None, timeout: Optional[float] = 60,
           url: Optional[str] = None) -> Replayed:
    """Runs the trajectory `runs` times from the same state and seed (see
    `run_trajectory`) and compares them with the first."""
    if runs < 2:
        raise ValueError("runs must be 2 or more: there is nothing to compare")
    got = [run_trajectory(source, actions, seed=seed, user=user, timeout=timeout, url=url)
           for _ in range(runs)]
    for t in got[1:]:
        if t.hash != got[0].hash:
            return Replayed(False, got, _difference(got[0], t))
    return Replayed(True, got)
