"""Scripted trajectories replayed from one state and seed (`forkbox.replay`)
against a real forkboxd."""

from __future__ import annotations

from forkbox import Sandbox
from forkbox.replay import replay

ACTIONS = [
    "echo $FORKBOX_SEED",
    "cat /run/forkbox/seed",
    # Randomness seeded from FORKBOX_SEED repeats with the seed.
    "awk -v s=$FORKBOX_SEED 'BEGIN { srand(s % 2147483647); print rand() }'",
]


def test_replay_repeats_a_seeded_trajectory_and_names_where_one_does_not(
        daemon_url: str) -> None:
    same = replay("minimal", ACTIONS, seed=7)
    assert same.same, same.first_difference
    assert len(set(same.hashes)) == 1 and same.first_difference is None
    seed = same.trajectories[0].steps[0].stdout
    assert seed.strip().isdigit() and same.trajectories[0].steps[1].stdout == seed
    # Another seed, another trajectory.
    assert replay("minimal", ACTIONS, seed=8).hashes[0] != same.hashes[0]
    # The kernel's own randomness does not repeat: the first step that
    # reads it is named.
    noisy = replay("minimal", ACTIONS + ["cat /proc/sys/kernel/random/uuid"], seed=7)
    assert not noisy.same
    assert noisy.first_difference is not None and noisy.first_difference[0] == 3, noisy
    assert noisy.hashes[0] != same.hashes[0]


def test_replay_from_a_running_sandbox_forks_it(daemon_url: str) -> None:
    with Sandbox.create("minimal", timeout=600) as sb:
        sb.commands.run("echo mid-episode > /tmp/state")
        r = replay(sb, ["cat /tmp/state", "echo $FORKBOX_SEED"], seed=11)
        assert r.same, r.first_difference
        assert r.trajectories[0].steps[0].stdout == "mid-episode\n"
        # The source is left as it was.
        assert sb.commands.run("cat /tmp/state").stdout == "mid-episode\n"


def test_gym_env_episodes_repeat_with_the_reset_seed(daemon_url: str) -> None:
    from forkbox.gym import SandboxEnv

    def episodes(seed: int) -> list:
        env = SandboxEnv("minimal", max_steps=2)
        try:
            seen = []
            for i in range(2):
                env.reset(seed=seed if i == 0 else None)
                seen.append(env.step("echo $FORKBOX_SEED")[0])
            return seen
        finally:
            env.close()

    a, b, c = episodes(5), episodes(5), episodes(6)
    assert a == b, (a, b)
    assert a[0] != a[1], "each episode its own seed"
    assert a[0] != c[0]
