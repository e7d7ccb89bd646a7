"""forkbox.gym.SandboxEnv against a real forkboxd."""

from __future__ import annotations

import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from forkbox.gym import (ENV_ID, GraderError, SandboxEnv, ShellOutput, checked_reward,
                         fit_text, score)
from forkbox.models import CommandResult


def test_sandbox_env_passes_gymnasiums_checker(daemon_url: str) -> None:
    env = gymnasium.make(ENV_ID, template="minimal", grader="test -f /tmp/solved",
                         max_steps=5, reset_command="echo ready", max_output_chars=4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    complaints = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert complaints == []
    env.close()
    assert env.unwrapped.sandbox is None  # type: ignore[attr-defined]


def test_sandbox_env_episode_rewards_terminates_and_truncates(daemon_url: str) -> None:
    env = SandboxEnv("minimal", grader="test -f /tmp/solved && echo 1 || { echo 0.25; exit 1; }",
                     max_steps=3, max_output_chars=64)
    try:
        obs, info = env.reset(seed=7)
        assert obs == "" and info == {"template": "minimal"}
        first = env.sandbox
        obs, reward, terminated, truncated, info = env.step("echo out; echo err >&2; exit 3")
        assert obs == "out\nerr\n"
        assert (reward, terminated, truncated) == (0.25, False, False)
        assert info["exit_code"] == 3 and info["grader_exit_code"] == 1
        obs, reward, terminated, truncated, _ = env.step(
            "i=1; while [ $i -le 1000 ]; do echo $i; i=$((i + 1)); done")
        assert len(obs) == 64 and obs.startswith("1\n2\n") and obs.endswith("999\n1000\n")
        assert obs in env.observation_space
        assert (reward, terminated, truncated) == (0.25, False, False)
        obs, reward, terminated, truncated, _ = env.step("touch /tmp/solved")
        assert (reward, terminated, truncated) == (1.0, True, False)
        # A new episode is a new sandbox, from the template's state again.
        env.reset()
        assert env.sandbox is not None and first is not None
        assert env.sandbox.sandbox_id != first.sandbox_id
        assert not first.is_running()
        for _ in range(2):
            _, reward, terminated, truncated, _ = env.step("true")
            assert (reward, terminated, truncated) == (0.25, False, False)
        _, _, terminated, truncated, _ = env.step("true")
        assert (terminated, truncated) == (False, True)
    finally:
        env.close()
        env.close()


def test_sandbox_env_policy_that_ends_its_guest_scores_zero_not_an_error(
        daemon_url: str) -> None:
    # As root, the policy can power off (or panic) its own machine: that is
    # its failure (terminated, reward 0, flagged), never an infrastructure
    # error.
    env = SandboxEnv("minimal", grader="test -f /tmp/solved", max_steps=3, user="root")
    try:
        env.reset()
        obs, reward, terminated, truncated, info = env.step("poweroff -f")
        assert (reward, terminated, truncated) == (0.0, True, False), info
        assert info["infrastructure"] is False
        assert "powered off" in info["guest_ended"], info
        assert obs in env.observation_space
        # The next episode is a fresh sandbox.
        env.reset()
        _, reward, terminated, _, _ = env.step("touch /tmp/solved")
        assert (reward, terminated) == (1.0, True)
    finally:
        env.close()


def test_score_and_fit_text_rules() -> None:
    def res(code: int, out: str = "") -> CommandResult:
        return CommandResult(out, "", code, 0.0, False)
    assert score(res(0)) == (1.0, True)
    assert score(res(1)) == (0.0, False)
    assert score(res(1, "log line\n0.5\n\n")) == (0.5, False)
    assert score(res(0, "-2e-1\n")) == (-0.2, True)
    # A reward out of range is an error, not a reward.
    for wild in ["1e308", "1.5", "-7"]:
        with pytest.raises(GraderError, match="outside"):
            score(res(0, f"{wild}\n"))
    assert score(res(0, "7\n"), (0.0, 10.0)) == (7.0, True)
    with pytest.raises(GraderError):
        checked_reward(float("nan"), (0.0, 1.0))
    space = ShellOutput(20)
    for text in ["", "plain\n", "crlf\r\nx", "\x00\x1b[31mred", "é✓" * 30]:
        assert fit_text(text, space) in space
    assert fit_text("a\r\nb\x07", space) == "a\nb?"
