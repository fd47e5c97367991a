"""Periodic evaluation of the current policy on a separate environment (rank 0, in process)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from overworld.core.config import RunConfig
from overworld.core.imports import call_generator, import_object
from overworld.policies.base import Policy, sample


@torch.no_grad()
def evaluate(policy: Policy, config: RunConfig, episodes: int, seed: int, device: torch.device) -> dict[str, float]:
    t = config.train_config
    env = call_generator(import_object(config.env_generator), {**config.env_kwargs, **t.eval_env_kwargs})
    returns, lengths = [], []
    try:
        for episode in range(episodes):
            obs, _ = env.reset(seed=seed + episode)
            state = policy.initial_state(1)
            first = torch.ones(1, 1, dtype=torch.bool, device=device)
            total, length, done = 0.0, 0, False
            while not done:
                obs_t = {k: torch.as_tensor(np.asarray(v), device=device)[None, None]
                         for k, v in (obs if isinstance(obs, dict) else {"obs": obs}).items()}
                out, state = policy(obs_t, state, first)
                if t.eval_deterministic:
                    action = {k: v.argmax(-1) for k, v in out.logits.items()}
                else:
                    action = sample(out.logits)
                act: Any = {k: v[0, 0].cpu().numpy() for k, v in action.items()}
                if list(act) == ["action"]:
                    act = act["action"].item()
                obs, reward, terminated, truncated, _ = env.step(act)
                total += float(reward)
                length += 1
                done = terminated or truncated
                first = torch.zeros(1, 1, dtype=torch.bool, device=device)
            returns.append(total)
            lengths.append(length)
    finally:
        env.close()
    return {"eval/mean_return": float(np.mean(returns)), "eval/mean_length": float(np.mean(lengths)),
            "eval/episodes": float(episodes)}
