"""`SandboxEnv`: a Gymnasium environment whose episodes are sandboxes.

    from forkbox.gym import SandboxEnv
    env = SandboxEnv("my-task", grader="test -f /work/done", max_steps=20)
    obs, info = env.reset(seed=0)          # a fresh fork of the template's zygote
    obs, reward, terminated, truncated, info = env.step("touch /work/done")

Actions are shell commands (`/bin/sh`, as the image's unprivileged `user`
unless `user=` names another, `"root"` say); the observation is what the
command printed, stdout and stderr interleaved, as text. Rewards come from
the grader, run after every step:

- a shell command: it exits 0 when the task is finished (the episode is
  then `terminated`), non-zero while it is not. Its reward is the last
  non-empty line of its stdout if that is a number, else 1.0 on exit 0 and
  0.0 otherwise. So `test -f /done` scores 0/1, and
  `python3 score.py` may print `0.25` and exit 1 to give partial credit
  without ending the episode. A grader that times out or is killed by a
  signal raises `GraderError`, and so does a reward outside
  `reward_range` (default -1..1) or one that is not finite.
- a callable `grader(sandbox, result) -> reward` or `-> (reward,
  terminated)`, given the `Sandbox` and the step's `CommandResult`.
- `None`: reward 0.0, never terminated.

The episode is `truncated` after `max_steps` steps. When the sandbox
machinery fails (create, a lost VM, the agent unreachable)
`InfrastructureError` is raised: mask such episodes, don't score them.
When the guest ends its own VM (powers off, reboots, panics its kernel)
the step is the policy's failure, not an error: the episode is
`terminated` with reward `0.0` and `info["guest_ended"]` says how.

Before each grading the env checks the sandbox's protected paths (the
template's `protect`: grader, tests; see `Template.build`). If the policy
changed any, the grader does not run: the episode is `terminated` with
reward `0.0`, and `info["tampered"]` lists the paths
(`check_integrity=False` skips the check).

With `grade_outputs=[paths]`, a shell grader runs where the policy has no
hand: in a fresh sandbox of the episode's template, as root, with only
those paths carried over from the episode (read as the policy's user; see
`forkbox.grading`). An output that cannot be carried (a link to the
expected answer, say) ends the episode with reward `0.0` and
`info["bad_output"]`.

Observations live in `observation_space`, a `Text` space: output is
sanitized (CR/LF to LF, characters outside the printable Basic
Multilingual Plane become `?`) and, past `max_output_chars`, its middle is
cut with a marker. `reset(seed=...)` seeds `np_random`, and from then on
every episode's sandbox is created with a seed drawn from it (see
`Sandbox.fork`): the entropy its kernel is given and its `FORKBOX_SEED`
repeat with the seed; `/dev/urandom` does not (the kernel mixes in the
CPU's randomness), so a task that wants repeatable randomness seeds its
generator from `FORKBOX_SEED`. An env never seeded creates sandboxes with
fresh host entropy.
"""

from __future__ import annotations

import functools
import math
import re
import string
from typing import (Any, Callable, Dict, List, Mapping, Optional, Sequence, SupportsFloat,
                    Tuple, Union)

import gymnasium
import numpy as np
from gymnasium import spaces

from .exceptions import ForkboxError, GuestEndedError, InfrastructureError
from .grading import OutputError, grade_in_fresh_sandbox
from .models import CommandResult
from .sandbox import Sandbox

Grader = Union[str, Callable[[Sandbox, CommandResult],
                             Union[SupportsFloat, Tuple[SupportsFloat, bool]]], None]


class GraderError(ForkboxError):
    """The grader command timed out or was killed: no reward can be read."""


@functools.lru_cache(maxsize=1)
def printable_charset() -> str:
    """Tab, newline, and every printable character of the Basic
    Multilingual Plane (what observations are made of)."""
    return "\t\n" + "".join(c for c in map(chr, range(0x20, 0x10000)) if c.isprintable())


class ShellOutput(spaces.Text):
    """Text of up to `max_length` characters from `printable_charset()`
    (the repr leaves out the 60,000-character charset)."""

    def __init__(self, max_length: int, seed: Optional[int] = None) -> None:
        super().__init__(max_length, min_length=0, charset=printable_charset(), seed=seed)

    def __repr__(self) -> str:
        return f"ShellOutput(max_length={self.max_length})"


class ShellCommand(spaces.Text):
    """A shell command: 1 to `max_length` characters of printable text.
    Its random samples are harmless `echo <word>` commands (random shell
    text would be destructive and nondeterministic): enough for checkers
    and smoke tests, while an agent may send any command."""

    def __init__(self, max_length: int, seed: Optional[int] = None) -> None:
        if max_length < 6:
            raise ValueError("max_length must leave room for a command (6 or more)")
        super().__init__(max_length, min_length=1, charset=printable_charset(), seed=seed)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        word_len = int(self.np_random.integers(1, min(16, self.max_length - 5) + 1))
        letters = string.ascii_letters + string.digits
        word = "".join(letters[int(i)] for i in self.np_random.integers(0, len(letters),
                                                                         size=word_len))
        return f"echo {word}"

    def __repr__(self) -> str:
        return f"ShellCommand(max_length={self.max_length})"


_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


#: The rewards `score` and `SandboxEnv` accept unless told otherwise.
DEFAULT_REWARD_RANGE: Tuple[float, float] = (-1.0, 1.0)


def score(result: CommandResult,
          reward_range: Tuple[float, float] = DEFAULT_REWARD_RANGE) -> Tuple[float, bool]:
    """(reward, terminated) from a grader command's result, by the rule in
    the module's doc. A reward outside `reward_range` (or not finite) is
    an error, not a reward: a policy that makes its grader print `1e308`
    gets `GraderError`, never a score."""
    if result.timed_out or result.exit_code is None:
        why = "timed out" if result.timed_out else f"was killed by signal {result.signal}"
        raise GraderError(f"the grader {why}: {result.stdout[-500:]}{result.stderr[-500:]}")
    done = result.exit_code == 0
    lines = [ln.strip() for ln in result.stdout.splitlines() if ln.strip()]
    if lines and _NUMBER.match(lines[-1]):
        return checked_reward(float(lines[-1]), reward_range), done
    return (1.0 if done else 0.0), done


def checked_reward(reward: float, reward_range: Tuple[float, float]) -> float:
    """`reward` if it is finite and inside `reward_range`; otherwise
    `GraderError`."""
    low, high = reward_range
    if not (math.isfinite(reward) and low <= reward <= high):
        raise GraderError(f"the grader's reward {reward!r} is outside {low}..{high} "
                          f"(SandboxEnv(reward_range=...) widens it): not taken as a reward",
                          "grader", 0, {"infrastructure": False})
    return reward


class SandboxEnv(gymnasium.Env[str, str]):
    """One sandbox per episode, forked from `template`'s zygote at each
    `reset`; the previous one is killed. See the module's doc for actions,
    observations and rewards."""

    # render_fps: nominal (a text transcript has no frame rate), declared
    # because video-recording wrappers and Gymnasium's checker ask for it.
    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, template: str, grader: Grader = None, *, max_steps: int = 50,
                 reset_command: Optional[str] = None, step_timeout: Optional[float] = 60.0,
                 grader_timeout: Optional[float] = 60.0, max_output_chars: int = 16384,
                 max_action_chars: int = 16384, user: Optional[Union[str, int]] = None,
                 cwd: Optional[str] = None, envs: Optional[Mapping[str, str]] = None,
                 sandbox_metadata: Optional[Mapping[str, str]] = None,
                 sandbox_timeout: Optional[float] = 3600.0, render_mode: Optional[str] = None,
                 network: Optional[Mapping[str, Any]] = None, url: Optional[str] = None,
                 reward_range: Tuple[float, float] = DEFAULT_REWARD_RANGE,
                 check_integrity: bool = True,
                 grade_outputs: Optional[Sequence[str]] = None) -> None:
        """`reset_command`: run after each reset, its output is the first
        observation (default: none, the first observation is `""`).
        `step_timeout`/`grader_timeout`: seconds per action / grading (an
        action that runs out is killed and reported with
        `info["timed_out"]`). `sandbox_timeout`: each sandbox's
        time-to-live, a safety net should `close()` never be called.
        `network`: each episode's egress policy (`{"allow_out": [...],
        "deny_out": [...]}`; default: nothing reachable). `reward_range`:
        the rewards a grader may give (default -1..1); any other, or one
        that is not finite, raises `GraderError` instead of scoring."""
        if max_steps < 1:
            raise ValueError("max_steps must be 1 or more")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r}: expected None or 'ansi'")
        self.template = template
        self.grader = grader
        if not reward_range[0] <= reward_range[1]:
            raise ValueError(f"reward_range {reward_range}: low above high")
        self.reward_range = (float(reward_range[0]), float(reward_range[1]))
        self.check_integrity = check_integrity
        self.grade_outputs = list(grade_outputs) if grade_outputs is not None else None
        if self.grade_outputs is not None and not isinstance(grader, str):
            raise ValueError("grade_outputs needs a shell-command grader")
        self._template = template
        self.max_steps = max_steps
        self.reset_command = reset_command
        self.step_timeout = step_timeout
        self.grader_timeout = grader_timeout
        self.user = user
        self.cwd = cwd
        self.envs = dict(envs or {})
        self.sandbox_metadata = dict(sandbox_metadata or {})
        self.sandbox_timeout = sandbox_timeout
        self.render_mode = render_mode
        self.network = dict(network) if network is not None else None
        self.url = url
        self._output_space = ShellOutput(max_output_chars)
        self.observation_space = self._output_space
        self.action_space = ShellCommand(max_action_chars)
        self.sandbox: Optional[Sandbox] = None
        """The current episode's sandbox (`None` before `reset` and after
        `close`)."""
        self._steps = 0
        self._transcript = ""
        self._seeded = False

    # -- gymnasium API

    def reset(self, *, seed: Optional[int] = None,
              options: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """Kills the previous sandbox and forks a fresh one from the
        template (`options={"template": name}` picks another for this
        episode)."""
        super().reset(seed=seed)
        if seed is not None:
            self._seeded = True
        sandbox_seed = int(self.np_random.integers(0, 2 ** 63)) if self._seeded else None
        template = str((options or {}).get("template", self.template))
        self._template = template
        self._kill()
        self._steps = 0
        self.sandbox = self._infra(lambda: Sandbox.create(
            template, timeout=self.sandbox_timeout, metadata=self.sandbox_metadata,
            envs=self.envs, network=self.network, seed=sandbox_seed, url=self.url))
        obs = ""
        if self.reset_command is not None:
            obs = self._observe(self._run(self.reset_command, self.step_timeout))
        self._transcript = obs
        return obs, {"template": template}

    def step(self, action: str) -> Tuple[str, float, bool, bool, Dict[str, Any]]:
        if self.sandbox is None:
            raise RuntimeError("call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"an action is a shell command string, not {type(action).__name__}")
        self._steps += 1
        try:
            result = self._run(action, self.step_timeout)
            obs = self._observe(result)
            tampered = self._tampered()
            if tampered:
                # The grader (or what it stands on) may be the policy's now.
                return self._policy_failed(action, obs, result, tampered=tampered)
            try:
                reward, terminated, grade = self._grade(result)
            except OutputError as e:
                return self._policy_failed(action, obs, result, bad_output=str(e))
        except GuestEndedError as e:
            # The policy ended its own machine: its failure, scored.
            return self._policy_failed(action, fit_text(str(e), self._output_space), None,
                                       guest_ended=str(e))
        truncated = not terminated and self._steps >= self.max_steps
        info: Dict[str, Any] = {"exit_code": result.exit_code, "timed_out": result.timed_out,
                                "steps": self._steps}
        info.update(grade)
        self._transcript = f"$ {action}\n{obs}"
        return obs, reward, terminated, truncated, info

    def _policy_failed(self, action: str, obs: str, result: Optional[CommandResult],
                       **why: Any) -> Tuple[str, float, bool, bool, Dict[str, Any]]:
        """A step that ends the episode as the policy's failure: reward 0,
        terminated, `why` in the info (never infrastructure)."""
        self._transcript = f"$ {action}\n{obs}"
        info: Dict[str, Any] = {"exit_code": result.exit_code if result else None,
                                "timed_out": result.timed_out if result else False,
                                "steps": self._steps, "infrastructure": False}
        info.update(why)
        return obs, 0.0, True, False, info

    def render(self) -> Optional[str]:
        """`ansi`: the last action and its output."""
        return self._transcript if self.render_mode == "ansi" else None

    def close(self) -> None:
        self._kill()
        super().close()

    # -- helpers

    def _kill(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            try:
                sb.kill()
            except ForkboxError:
                pass  # already gone, or the daemon is: the TTL finishes it

    def _run(self, cmd: str, timeout: Optional[float]) -> CommandResult:
        sb = self.sandbox
        assert sb is not None
        # `exec 2>&1`: one stream, in the order the command wrote it.
        result: CommandResult = self._infra(lambda: sb.commands.run(
            "exec 2>&1\n" + cmd, timeout=timeout, user=self.user, cwd=self.cwd))
        return result

    def _grade(self, result: CommandResult) -> Tuple[float, bool, Dict[str, Any]]:
        g = self.grader
        if g is None:
            return 0.0, False, {}
        if isinstance(g, str):
            sb = self.sandbox
            assert sb is not None
            outputs = self.grade_outputs
            if outputs is not None:
                graded = self._infra(lambda: grade_in_fresh_sandbox(
                    sb, outputs, g, template=self._template, timeout=self.grader_timeout,
                    cwd=self.cwd, url=self.url))
                r = graded.result
            else:
                r = self._infra(lambda: sb.commands.run(g, timeout=self.grader_timeout,
                                                        user=self.user, cwd=self.cwd))
            reward, done = score(r, self.reward_range)
            return reward, done, {"grader_exit_code": r.exit_code}
        assert self.sandbox is not None
        out = g(self.sandbox, result)
        if isinstance(out, tuple):
            return checked_reward(float(out[0]), self.reward_range), bool(out[1]), {}
        return checked_reward(float(out), self.reward_range), False, {}

    def _tampered(self) -> List[str]:
        """The protected paths the policy changed (none if the template
        protects nothing, or nothing grades)."""
        sb = self.sandbox
        if sb is None or self.grader is None or not self.check_integrity:
            return []
        report = self._infra(sb.integrity.check)
        return [] if report else list(report.tampered)

    def _observe(self, result: CommandResult) -> str:
        return fit_text(result.stdout, self._output_space)

    def _infra(self, call: Callable[[], Any]) -> Any:
        """Runs a call to the daemon; a failure because this episode's VM
        was lost becomes `InfrastructureError` (the daemon reports a dead
        sandbox as a conflict)."""
        try:
            return call()
        except InfrastructureError:
            raise
        except ForkboxError as e:
            if self.sandbox is not None and e.kind == "conflict" and self._vm_lost():
                raise InfrastructureError(f"the episode's sandbox VM was lost: {e}",
                                          "infrastructure",
                                          detail={"infrastructure": True}) from e
            raise

    def _vm_lost(self) -> bool:
        assert self.sandbox is not None
        try:
            death = self.sandbox.get_info().get("death")
        except ForkboxError:
            return False
        # A death by `guest_ended` needs no translation: the daemon already
        # answers calls to such a sandbox with `GuestEndedError`.
        return isinstance(death, dict) and "vm_lost" in death


def fit_text(text: str, space: spaces.Text) -> str:
    """`text` made a member of `space`: line ends normalized, characters
    outside its charset replaced by `?`, and the middle cut (with a
    marker) when it is too long."""
    allowed = space.character_set
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if any(c not in allowed for c in text):
        text = "".join(c if c in allowed else "?" for c in text)
    limit = space.max_length
    if len(text) > limit:
        marker = f"\n[... {len(text) - limit} characters cut ...]\n"
        if len(marker) >= limit:
            text = text[:limit]
        else:
            head = (limit - len(marker)) // 2
            tail = limit - len(marker) - head
            marker = f"\n[... {len(text) - head - tail} characters cut ...]\n"
            text = text[:head] + marker + (text[-tail:] if tail else "")
            text = text[:limit]
    if len(text) < space.min_length:
        text = text.ljust(space.min_length)
    return text


__all__ = ["SandboxEnv", "ShellCommand", "ShellOutput", "GraderError", "score", "fit_text",
           "checked_reward", "printable_charset", "ENV_ID", "DEFAULT_REWARD_RANGE"]

# `gymnasium.make("forkbox/Sandbox-v0", template=..., grader=...)`.
ENV_ID = "forkbox/Sandbox-v0"
if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="forkbox.gym:SandboxEnv")
