"""The MineStudio adapters without minestudio: the env adapter on a MinecraftSim stand-in, the
policy adapter on a duck-typed MinePolicy, and both through a real rollout worker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from overworld.core.specs import spaces_from_gym
from overworld.envs.gym_tasks import make_env
from overworld.envs.minestudio import adapt_env
from overworld.policies.base import log_prob, sample
from overworld.policies.minestudio import MinePolicyAdapter, as_policy, is_mine_policy
from tests.minestudio import fake_policy, minecraft_sim_standin
from tests.minestudio.quick_start import run_quick_start


def test_env_adapter_keeps_minecraftsim_semantics() -> None:
    env = adapt_env(minecraft_sim_standin.env_generator())
    spaces = spaces_from_gym(env.observation_space, env.action_space)
    size = minecraft_sim_standin.SIZE
    assert set(spaces.obs) == {"image"} and spaces.obs["image"].shape == (size, size, 3)
    assert {k: s.shape for k, s in spaces.action.items()} == {"buttons": (), "camera": ()}
    obs, _ = env.reset(seed=3)
    assert set(obs) == {"image"}
    for _ in range(24):
        obs, reward, terminated, truncated, _ = env.step({"buttons": np.int64(2), "camera": np.int64(60)})
        assert reward == 1.0 and not terminated and not truncated
    _, _, terminated, truncated, _ = env.step({"buttons": np.int64(1), "camera": np.int64(0)})
    assert terminated and not truncated  # MinecraftSim's done is a termination
    cartpole = make_env("CartPole-v1")
    assert adapt_env(cartpole) is cartpole  # ordinary envs pass through untouched


def test_generic_mine_policy_resets_state_at_episode_starts() -> None:
    mine = fake_policy.policy_generator()
    assert is_mine_policy(mine)
    policy = as_policy(mine)
    assert isinstance(policy, MinePolicyAdapter)
    B, T = 2, 6
    obs = {"image": torch.randint(0, 256, (B, T, 8, 8, 3), dtype=torch.uint8)}
    state = {"s0": torch.randn(B, fake_policy.HID)}
    first = torch.zeros(B, T, dtype=torch.bool)
    first[0, 3] = True  # env 0 starts a new episode at t=3
    out, new_state = policy(obs, state, first)
    assert out.logits["buttons"].shape == (B, T, 8641) and out.vpred.shape == (B, T)
    # env 0 from t=3 equals a fresh run on its last 3 steps
    tail = {"image": obs["image"][:1, 3:]}
    fresh, fresh_state = policy(tail, policy.initial_state(1), torch.zeros(1, 3, dtype=torch.bool))
    torch.testing.assert_close(out.vpred[:1, 3:], fresh.vpred)
    torch.testing.assert_close(new_state["s0"][:1], fresh_state["s0"])
    # env 1 is unaffected: one uninterrupted run from its carried state
    whole, _ = policy({"image": obs["image"][1:]}, {"s0": state["s0"][1:]}, torch.zeros(1, T, dtype=torch.bool))
    torch.testing.assert_close(out.vpred[1:], whole.vpred)
    action = sample(out.logits)
    pi = mine.pi_head  # the adapter's logits are the pi_head's log-probabilities
    expected = sum(torch.gather(v, -1, action[k].unsqueeze(-1)).squeeze(-1)
                   for k, v in {k: t.squeeze(2) for k, t in pi(torch.zeros(B, T, fake_policy.HID)).items()}.items())
    assert expected.shape == log_prob(out.logits, action).shape
    parts = policy.split_states(new_state, B)
    torch.testing.assert_close(policy.merge_states(parts)["s0"], new_state["s0"])


def test_rollout_worker_runs_a_minestudio_style_file(make_cluster_from_file, tmp_path: Path) -> None:
    run_quick_start(make_cluster_from_file, tmp_path, "policy_generator", module="fake_policy")
