"""The Crafter benchmark task (unmodified Crafter, gymnasium API) and its score."""

from __future__ import annotations

import math

import crafter
import numpy as np
import pytest

from overworld.envs.crafter_score import ACHIEVEMENTS, crafter_score, success_rates
from overworld.envs.crafter_task import make_env
from overworld.policies.impala import make_impala_policy
from overworld.trainer.minestudio_metrics import crafter_metrics
from overworld.v1 import rollout_manager_pb2


def test_achievements_are_crafters_own() -> None:
    assert tuple(crafter.constants.achievements) == ACHIEVEMENTS and len(ACHIEVEMENTS) == 22


def test_score_of_hand_made_success_rates() -> None:
    assert crafter_score(dict.fromkeys(ACHIEVEMENTS, 0.0)) == pytest.approx(0.0, abs=1e-12)
    assert crafter_score(dict.fromkeys(ACHIEVEMENTS, 100.0)) == pytest.approx(100.0)
    # 11 achievements at 99%, 11 at 0%: exp((11 ln 100 + 11 ln 1) / 22) - 1 = sqrt(100) - 1 = 9
    half = {name: (99.0 if i % 2 else 0.0) for i, name in enumerate(ACHIEVEMENTS)}
    assert crafter_score(half) == pytest.approx(9.0)
    # one achievement at 100%, the rest at 0%: (101 ** (1/22)) - 1, far below the arithmetic mean 4.5
    one = {name: (100.0 if name == "collect_wood" else 0.0) for name in ACHIEVEMENTS}
    assert crafter_score(one) == pytest.approx(101 ** (1 / 22) - 1) and crafter_score(one) < 0.25
    mixed = {name: float(i) * 4.0 for i, name in enumerate(ACHIEVEMENTS)}
    expected = math.exp(sum(math.log(1 + 4.0 * i) for i in range(22)) / 22) - 1
    assert crafter_score(mixed) == pytest.approx(expected)


def test_score_rejects_what_is_not_a_percentage() -> None:
    with pytest.raises(ValueError, match="missing"):
        crafter_score({"collect_wood": 50.0})
    with pytest.raises(ValueError, match="percentages"):
        crafter_score({**dict.fromkeys(ACHIEVEMENTS, 0.0), "collect_wood": 150.0})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        success_rates({"achievement_collect_wood": 3.0})


def test_success_rates_from_episode_fractions() -> None:
    rates = success_rates({"achievement_collect_wood": 0.5, "achievement_wake_up": 1.0, "cows_eaten": 7.0})
    assert rates["collect_wood"] == 50.0 and rates["wake_up"] == 100.0
    assert rates["collect_diamond"] == 0.0 and len(rates) == 22


def test_death_terminates_and_the_time_limit_truncates() -> None:
    env = make_env(seed=0)
    env.reset(seed=3)
    env._env._player.health = 0
    _, _, terminated, truncated, info = env.step(0)
    assert terminated and not truncated
    assert set(info["achievements"]) == {f"achievement_{a}" for a in ACHIEVEMENTS}
    env.reset(seed=4)
    env._env._length = 5  # Crafter's 10,000-step limit, shortened for the test
    ends = [env.step(0)[2:4] for _ in range(5)]
    assert ends[-1] == (False, True) and all(e == (False, False) for e in ends[:-1])


def test_the_world_is_crafters_default() -> None:
    env = make_env(seed=0)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (64, 64, 3) and obs.dtype == np.uint8 and env.action_space.n == 17
    assert env._env._area == (64, 64) and env._env._length == 10000 and env._env._reward


def test_impala_policy_shapes() -> None:
    import torch

    env = make_env()
    for recurrent in (False, True):
        policy = make_impala_policy(env.observation_space, env.action_space, channels=[8, 16, 16], blocks=1,
                                    hidden=32, recurrent=recurrent)
        obs = {"obs": torch.randint(0, 255, (2, 3, 64, 64, 3), dtype=torch.uint8)}
        out, state = policy(obs, policy.initial_state(2), torch.zeros(2, 3, dtype=torch.bool))
        assert out.logits["action"].shape == (2, 3, 17) and out.vpred.shape == (2, 3)
        assert bool(state) == recurrent


def test_the_trainer_logs_the_runs_crafter_score() -> None:
    """The trainer's metrics (TensorBoard, W&B, console) carry the score over all the run's episodes,
    from the rollout-manager's totals; tasks without achievements get none."""
    extras = {f"achievement_{name}": (4.0 if name == "collect_wood" else 0.0) for name in ACHIEVEMENTS}
    fleet = rollout_manager_pb2.FleetStatus(tasks=[
        rollout_manager_pb2.TaskStats(task="crafter", episodes=8, total_extras=extras),
        rollout_manager_pb2.TaskStats(task="cartpole", episodes=3, total_return=30.0)])
    metrics = crafter_metrics(fleet)
    assert metrics["crafter/crafter/success_rate/collect_wood"] == 50.0
    assert metrics["crafter/crafter/score"] == pytest.approx(51 ** (1 / 22) - 1)
    assert not any(k.startswith("crafter/cartpole") for k in metrics) and len(metrics) == 23
