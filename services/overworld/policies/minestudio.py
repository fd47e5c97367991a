"""MineStudio's `MinePolicy` (VPT and friends) behind overworld's `Policy` interface, unchanged.

The adapter keeps the MinePolicy as a submodule (`self.mine`, so its state_dict keys are its own
under `mine.`) and uses only its public parts:

- `initial_state(B)`: MineStudio's list of batch-first tensors becomes the dict
  `{"s0": ..., "s1": ...}` (copied: VPT caches and reuses its initial states);
- `merge_state` / `split_state`: used by `merge_states` / `split_states` here, for tools that hold
  per-env states MineStudio's way;
- `forward`: VPT-style policies (a `net(obs, state, context={"first": first})` body) are called
  through the body so that episode starts reset the memory inside a sequence (VPTPolicy.forward
  hard-codes `first = False`, a known MineStudio defect); other MinePolicies are called through
  `forward(input, state_in)`, split at episode starts, with the state of starting entries reset
  to `initial_state`;
- `pi_head` gives the action log-probabilities (B, T, 1, n) per action key, handed on as (B, T, n)
  logits: `Categorical(logits)` then has exactly `pi_head.logprob` / `entropy` / `kl_divergence`;
- `value_head` gives `vpred` (in normalised space; overworld's ValueNormalizer denormalises).

Actions are one integer per key (`buttons` in [0, 8641), `camera` in [0, 121) for VPT); the env
adapter (overworld.envs.minestudio) turns them back into MinecraftSim's `np.array([a])`.

Nothing here imports minestudio: a MinePolicy is recognised by its methods.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch
from torch import nn

from overworld.policies.base import Policy, PolicyOutput, State

MINE_POLICY_METHODS = ("initial_state", "merge_state", "split_state", "forward")


def is_mine_policy(obj: Any) -> bool:
    return (isinstance(obj, nn.Module) and all(callable(getattr(obj, m, None)) for m in MINE_POLICY_METHODS)
            and hasattr(obj, "pi_head") and hasattr(obj, "value_head"))


def _has_vpt_body(mine: nn.Module) -> bool:
    net = getattr(mine, "net", None)
    if net is None or not callable(getattr(net, "forward", None)):
        return False
    import inspect

    try:
        return "context" in inspect.signature(net.forward).parameters
    except (TypeError, ValueError):
        return False


class MinePolicyAdapter(Policy):
    # a MineStudio MinePolicy (an nn.Module, checked by is_mine_policy): its methods, heads and body are
    # found by duck typing (minestudio is not imported here), so the type checker takes it as Any
    mine: Any

    def __init__(self, mine: nn.Module, action_keys: list[str] | None = None) -> None:
        super().__init__()
        if not is_mine_policy(mine):
            raise TypeError(f"{type(mine).__name__} is not a MineStudio MinePolicy "
                            f"(needs {', '.join(MINE_POLICY_METHODS)}, pi_head, value_head)")
        self.mine = mine
        self.action_keys = action_keys
        self._vpt = _has_vpt_body(mine)

    # -- state -----------------------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return next(self.mine.parameters()).device

    def _to_dict(self, states: list[torch.Tensor] | None) -> State:
        return {f"s{i}": t for i, t in enumerate(states or [])}

    def _to_list(self, state: State) -> list[torch.Tensor] | None:
        return [state[f"s{i}"] for i in range(len(state))] if state else None

    def initial_state(self, batch_size: int) -> State:
        states = self.mine.initial_state(batch_size)
        if states is None:
            return {}
        return {k: v.clone().to(self._device) for k, v in self._to_dict(list(states)).items()}

    def merge_states(self, per_env: list[State]) -> State:
        """Per-env states (batch 1 each) into one batch, with MineStudio's merge_state."""
        merged = self.mine.merge_state([self._to_list(s) for s in per_env])
        return self._to_dict(merged)

    def split_states(self, state: State, n: int) -> list[State]:
        return [self._to_dict(s) for s in self.mine.split_state(self._to_list(state), n)]

    # -- forward -----------------------------------------------------------------------------------
    def _logits(self, pi_logits: dict[str, torch.Tensor], B: int, T: int) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in pi_logits.items():
            if self.action_keys is not None and k not in self.action_keys:
                continue
            if v.dim() == 4 and v.shape[2] != 1:
                raise ValueError(f"action {k!r}: {v.shape[2]} components per step; only one is supported")
            out[k] = v.reshape(B, T, v.shape[-1]).float()
        return out

    def _run(self, obs: dict[str, torch.Tensor], states: list[torch.Tensor] | None,
             first: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
        if self._vpt:
            (pi_h, v_h), state_out = self.mine.net(obs, states, context={"first": first})
            return {"pi_logits": self.mine.pi_head(pi_h), "vpred": self.mine.value_head(v_h)}, state_out
        B, T = first.shape
        starts = sorted({0, *[int(t) for t in torch.nonzero(first.any(0)).flatten().tolist()]})
        outs: list[dict[str, Any]] = []
        for i, t0 in enumerate(starts):
            t1 = starts[i + 1] if i + 1 < len(starts) else T
            if states is not None and first[:, t0].any():
                fresh = self.mine.initial_state(B)
                keep = ~first[:, t0]
                states = [torch.where(keep.view(B, *([1] * (s.dim() - 1))), s, f.to(s.device, s.dtype))
                          for s, f in zip(states, fresh, strict=True)]
            out, states = self.mine(dict_slice(obs, t0, t1), states)
            outs.append(out)
        if len(outs) == 1:
            return outs[0], states
        return {"pi_logits": {k: torch.cat([o["pi_logits"][k] for o in outs], 1) for k in outs[0]["pi_logits"]},
                "vpred": torch.cat([o["vpred"] for o in outs], 1)}, states

    def forward(self, obs: dict[str, torch.Tensor], state: State, first: torch.Tensor) -> tuple[PolicyOutput, State]:
        any_obs = next(iter(obs.values()))
        B, T = any_obs.shape[:2]
        latents, state_out = self._run(obs, self._to_list(state), first.bool())
        vpred = latents["vpred"].reshape(B, T).float()
        return PolicyOutput(self._logits(latents["pi_logits"], B, T), vpred), self._to_dict(state_out)

    @torch.no_grad()
    def sample_actions(self, logits: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One step's actions as MineStudio's RolloutWorker draws them: `pi_head.sample(pi_logits,
        deterministic=False)` (so the head's temperature and nucleus_prob apply), with their
        `pi_head.logprob`. logits: (B, 1, n) per key; returns (B,) actions and (B,) log-probs."""
        head = self.mine.pi_head
        if not (callable(getattr(head, "sample", None)) and callable(getattr(head, "logprob", None))):
            from overworld.policies.base import log_prob, sample

            action = sample(logits)
            return {k: v.reshape(-1) for k, v in action.items()}, log_prob(logits, action).reshape(-1)
        pi_logits = {k: v.unsqueeze(2) for k, v in logits.items()}  # MineStudio's (B, T, 1, n)
        sampled = head.sample(pi_logits, deterministic=False)
        logp = head.logprob(sampled, pi_logits)
        return {k: sampled[k].reshape(-1) for k in logits}, logp.reshape(-1).float()

    def value_head_modules(self) -> list[nn.Module]:
        return [self.mine.value_head]

    def encoder_modules(self) -> list[nn.Module]:
        net = getattr(self.mine, "net", None)
        return [m for m in (getattr(net, "img_process", None),) if m is not None]


def dict_slice(obs: dict[str, torch.Tensor], t0: int, t1: int) -> dict[str, torch.Tensor]:
    return {k: v[:, t0:t1] for k, v in obs.items()}


def wrap_mine_policy(mine: nn.Module, action_space: gym.Space | None = None) -> MinePolicyAdapter:
    keys = list(action_space.spaces) if isinstance(action_space, gym.spaces.Dict) else None
    return MinePolicyAdapter(mine, keys)


def as_policy(policy: Any, action_space: gym.Space | None = None) -> Policy:
    """An overworld Policy as is; a MinePolicy wrapped."""
    if isinstance(policy, Policy):
        return policy
    if is_mine_policy(policy):
        return wrap_mine_policy(policy, action_space)
    raise TypeError(f"{type(policy).__name__} is neither an overworld Policy nor a MineStudio MinePolicy")
