"""The policy interface every learner and rollout worker uses.

A policy maps observations (dict of (B, T, ...) tensors), the recurrent state before step 0 and
the `first` flags (B, T) to action logits (dict of (B, T, n)) and a value prediction `vpred`
(B, T). Where `first` is set the recurrent state is reset before that step, inside the sequence.
With `use_normalized_vf` the value head predicts in normalised space; `value()` denormalises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.distributions import Categorical

State = dict[str, torch.Tensor]


@dataclass
class PolicyOutput:
    logits: dict[str, torch.Tensor]
    vpred: torch.Tensor


class ValueNormalizer(nn.Module):
    """EWMA mean and variance of value targets (MineStudio's normalised value function): VPT's
    NormalizeEwma, with moments that start at zero and a variance floor of 1e-2 (std >= 0.1)."""

    # the buffers registered below (nn.Module's __getattr__ finds them): their type, for the type checker
    mean: torch.Tensor
    mean_sq: torch.Tensor
    debias: torch.Tensor

    def __init__(self, beta: float = 0.99999, enabled: bool = False) -> None:
        super().__init__()
        self.beta = beta
        self.enabled = enabled
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("mean_sq", torch.zeros(()))
        self.register_buffer("debias", torch.zeros(()))

    def _moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        debias = self.debias.clamp(min=1e-8)
        mean = self.mean / debias
        var = (self.mean_sq / debias - mean**2).clamp(min=1e-2)
        return mean, var.sqrt()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or self.debias.item() == 0:
            return x
        mean, std = self._moments()
        return (x - mean) / std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or self.debias.item() == 0:
            return x
        mean, std = self._moments()
        return x * std + mean

    @torch.no_grad()
    def update(self, batch_mean: torch.Tensor, batch_mean_sq: torch.Tensor) -> None:
        """Update from the global batch moments (already all-reduced across ranks)."""
        if not self.enabled:
            return
        w = 1.0 - self.beta
        self.mean.mul_(self.beta).add_(w * batch_mean)
        self.mean_sq.mul_(self.beta).add_(w * batch_mean_sq)
        self.debias.mul_(self.beta).add_(w)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value_normalizer = ValueNormalizer()

    def initial_state(self, batch_size: int) -> State:
        return {}

    def forward(self, obs: dict[str, torch.Tensor], state: State, first: torch.Tensor) -> tuple[PolicyOutput, State]:
        raise NotImplementedError

    def value(self, out: PolicyOutput) -> torch.Tensor:
        return self.value_normalizer.denormalize(out.vpred)

    def value_head_modules(self) -> list[nn.Module]:
        """Modules zeroed by zero_initial_vf and kept trainable by fix_decoder."""
        return []

    def encoder_modules(self) -> list[nn.Module]:
        """Modules kept trainable by fix_decoder."""
        return []


def distributions(logits: dict[str, torch.Tensor]) -> dict[str, Categorical]:
    # No argument validation: it costs a sync and more than a small policy's forward, and an action out
    # of range fails in log_prob's gather all the same.
    return {k: Categorical(logits=v, validate_args=False) for k, v in logits.items()}


def log_prob(logits: dict[str, torch.Tensor], action: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(d.log_prob(action[k]) for k, d in distributions(logits).items())


def entropy(logits: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(d.entropy() for d in distributions(logits).values())


def kl_divergence(p_logits: dict[str, torch.Tensor], q_logits: dict[str, torch.Tensor]) -> torch.Tensor:
    """KL(p || q), summed over action components."""
    terms: list[torch.Tensor] = []
    for k, p in p_logits.items():
        logp = torch.log_softmax(p, -1)
        logq = torch.log_softmax(q_logits[k], -1)
        terms.append((logp.exp() * (logp - logq)).sum(-1))
    return cast(torch.Tensor, sum(terms))  # sum's 0 only for no action components: no policy has none


def sample(logits: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: d.sample() for k, d in distributions(logits).items()}


def reset_state(state: State, first: torch.Tensor) -> State:
    """Zero the state of the batch entries whose step starts an episode. first: (B,)."""
    if not state:
        return {}
    keep = (~first).to(next(iter(state.values())).dtype)
    return {k: v * keep.view(-1, *([1] * (v.dim() - 1))) for k, v in state.items()}
