"""What policy lag costs PPO on CartPole, and whether the decoupled objective buys it back: one process,
no services, the hyperparameters of examples/cartpole.yaml (8 envs x 32 steps an iteration, 20 epochs
of one 256-step minibatch, lr 1e-3 annealed, gamma 0.98, lambda 0.8, clip 0.2, MLP 64-64), with each
iteration's data stepped by the policy of `lag` iterations before (0: on-policy; a fleet's fragments
are trained on 1-2 versions after they were stepped, docs/replay_buffer.md "Sizing the room").

Two objectives: PPO's ratio to the behaviour policy (what the learner does: trainer/loss.py), and the
decoupled one of Hilton et al. 2021 ("Batch size-invariance for policy optimization"), which clips the
ratio to the learner's own policy at the start of the iteration and weighs by that policy's ratio to
the behaviour's (clipped at 2), a proposed cure for lag. Per run: env steps until the mean return of the
last 100 episodes reaches 450 (at most 250,000).

    python -m bench.bench_policy_lag       -> bench/results/policy_lag.json

Knobs (environment): BENCH_LAG_SEEDS (1,2,3), BENCH_LAG_LAGS (0,1,2,3).
"""

from __future__ import annotations

import collections
import copy
import os
import statistics
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from bench.runs import RunRecord, write

ENVS, STEPS, EPOCHS, LR, GAMMA, LAMBDA, CLIP, WEIGHT_CLIP = 8, 32, 20, 1e-3, 0.98, 0.8, 0.2, 2.0
TARGET, BUDGET = 450.0, 250_000


def mlp(out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, out))


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi, self.v = mlp(2), mlp(1)

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        return torch.distributions.Categorical(logits=self.pi(obs))


def steps_to_target(lag: int, decoupled: bool, seed: int) -> int | None:
    torch.manual_seed(seed)
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(ENVS)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    agent = Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=LR, eps=1e-5)
    obs, _ = envs.reset(seed=seed)
    policies: collections.deque[dict[str, Any]] = collections.deque(maxlen=lag + 1)
    returns: collections.deque[float] = collections.deque(maxlen=100)
    episode_return = np.zeros(ENVS)
    steps = 0
    while steps < BUDGET:
        policies.append(copy.deepcopy(agent.state_dict()))
        behaviour = Agent()
        behaviour.load_state_dict(policies[0])  # the policy of `lag` iterations before
        rollout: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
        for _ in range(STEPS):
            o = torch.as_tensor(obs, dtype=torch.float32)
            with torch.no_grad():
                d = behaviour.dist(o)
                a = d.sample()
            obs, r, terminated, truncated, info = envs.step(a.numpy())
            final = obs.copy()
            if "final_obs" in info:
                for i in np.flatnonzero(info["_final_obs"]):
                    final[i] = info["final_obs"][i]
            episode_return += r
            for i in np.flatnonzero(terminated | truncated):
                returns.append(float(episode_return[i]))
                episode_return[i] = 0.0
            for key, value in (("obs", o), ("action", a), ("logp", d.log_prob(a)), ("reward", r),
                               ("terminated", terminated), ("truncated", truncated), ("next_obs", final)):
                rollout[key].append(torch.as_tensor(value, dtype=torch.float32 if key != "action" else torch.int64))
        steps += ENVS * STEPS
        if len(returns) == 100 and np.mean(returns) >= TARGET:
            return steps
        o, a, behaviour_logp, r, term, trunc, next_o = (torch.stack(rollout[k]) for k in (
            "obs", "action", "logp", "reward", "terminated", "truncated", "next_obs"))
        with torch.no_grad():
            value, next_value = agent.v(o).squeeze(-1), agent.v(next_o).squeeze(-1)
            proximal_logp = agent.dist(o).log_prob(a)
            advantage, running = torch.zeros_like(r), torch.zeros(ENVS)
            for t in reversed(range(STEPS)):  # GAE: truncation bootstraps, termination does not
                delta = r[t] + GAMMA * next_value[t] * (1 - term[t]) - value[t]
                running = delta + GAMMA * LAMBDA * (1 - torch.maximum(term[t], trunc[t])) * running
                advantage[t] = running
            target = advantage + value
        for group in optimizer.param_groups:
            group["lr"] = LR * (1 - steps / 1e6)  # annealed over the example's 1,000 iterations
        o, a, behaviour_logp, proximal_logp = o.reshape(-1, 4), a.reshape(-1), behaviour_logp.reshape(-1), \
            proximal_logp.reshape(-1)
        advantage, target = advantage.reshape(-1), target.reshape(-1)
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        for _ in range(EPOCHS):
            logp = agent.dist(o).log_prob(a)
            if decoupled:
                ratio = torch.exp(logp - proximal_logp)
                weight = torch.exp(proximal_logp - behaviour_logp).clamp(max=WEIGHT_CLIP)
            else:
                ratio, weight = torch.exp(logp - behaviour_logp), torch.ones(())
            policy_loss = (weight * torch.max(-advantage * ratio, -advantage * ratio.clamp(1 - CLIP, 1 + CLIP))).mean()
            value_loss = 0.5 * ((agent.v(o).squeeze(-1) - target) ** 2).mean()
            optimizer.zero_grad()
            (policy_loss + 0.5 * value_loss).backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            optimizer.step()
    return None


def main() -> None:
    torch.set_num_threads(1)
    seeds = [int(s) for s in os.environ.get("BENCH_LAG_SEEDS", "1,2,3").split(",")]
    lags = [int(x) for x in os.environ.get("BENCH_LAG_LAGS", "0,1,2,3").split(",")]
    runs = []
    for seed in seeds:
        for lag in lags:
            for decoupled in (False, True) if lag else (False,):  # at lag 0 the two objectives are one
                with RunRecord() as record:
                    steps = steps_to_target(lag, decoupled, seed)
                run = {"lag": lag, "objective": "decoupled" if decoupled else "ppo", "seed": seed,
                       "env_steps_to_target": steps, **record.fields}
                print(run, flush=True)
                runs.append(run)
    medians = {f"{objective}-lag{lag}": statistics.median(
        [r["env_steps_to_target"] if r["env_steps_to_target"] is not None else BUDGET for r in runs
         if r["lag"] == lag and r["objective"] == objective])
        for lag in lags for objective in ("ppo", "decoupled") if lag or objective == "ppo"}
    write("policy_lag", {"target_return": TARGET, "budget_env_steps": BUDGET, "seeds": seeds,
                         "median_env_steps_to_target": medians, "runs": runs})


if __name__ == "__main__":
    main()
