"""The PPO loss, term by term: ratios against the behaviour log-probs recorded at rollout time, a
clipped value loss, the entropy bonus and KL(pi || reference). Each term's name is the one it is
logged under (`trainer/<name>`); what differs from MineStudio's loss is in docs/trainer.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from overworld.policies.base import PolicyOutput, entropy, kl_divergence, log_prob


@dataclass
class LossConfig:
    ppo_clip: float
    clip_vloss: bool
    ppo_policy_coef: float
    ppo_vf_coef: float
    entropy_bonus_coef: float
    log_ratio_range: float


@dataclass
class LossTerms:
    total_loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy_bonus: torch.Tensor
    kl_divergence_loss: torch.Tensor
    approx_kl: torch.Tensor
    clip_fraction: torch.Tensor


LOSS_TERMS = tuple(f.name for f in fields(LossTerms))


class LossMeans:
    """Each loss term's mean over the windows of an iteration, as the logged `trainer/<name>`."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(LOSS_TERMS, 0.0)
        self.windows = 0

    def add(self, terms: LossTerms) -> None:
        for name in LOSS_TERMS:
            self.sums[name] += float(getattr(terms, name).detach())
        self.windows += 1

    def metrics(self) -> dict[str, float]:
        return {f"trainer/{name}": total / max(self.windows, 1) for name, total in self.sums.items()}


def ppo_loss(out: PolicyOutput, action: dict[str, torch.Tensor], behaviour_logp: torch.Tensor,
             advantage: torch.Tensor, target_vpred: torch.Tensor, old_vpred: torch.Tensor,
             ref_logits: dict[str, torch.Tensor] | None, kl_coef: float, cfg: LossConfig,
             value_only: bool = False) -> LossTerms:
    """All inputs are (B, T); `target_vpred` and `old_vpred` are in the value head's (normalised) space.
    `kl_coef`: the weight of KL(pi || reference), rho (1 during the value warm-up).

    `value_only` (the value warm-up): value loss and KL term only. The logits still enter the total
    with weight zero, so that every parameter the forward used gets a (zero) gradient: under DDP a
    parameter that produced an output but no gradient would leave the all-reduce waiting."""
    logp = log_prob(out.logits, action)
    log_ratio = torch.clamp(logp - behaviour_logp, max=cfg.log_ratio_range)
    ratio = torch.exp(log_ratio)
    surrogate = torch.max(-advantage * ratio, -advantage * torch.clamp(ratio, 1 - cfg.ppo_clip, 1 + cfg.ppo_clip))
    policy_loss = surrogate.mean()

    vpred = out.vpred
    if cfg.clip_vloss:
        clipped = old_vpred + torch.clamp(vpred - old_vpred, -cfg.ppo_clip, cfg.ppo_clip)
        value_loss = 0.5 * torch.max((vpred - target_vpred) ** 2, (clipped - target_vpred) ** 2).mean()
    else:
        value_loss = 0.5 * ((vpred - target_vpred) ** 2).mean()

    entropy_bonus = entropy(out.logits).mean()
    kl_divergence_loss = (kl_divergence(out.logits, ref_logits).mean() if ref_logits is not None
                          else torch.zeros((), device=vpred.device))
    if value_only:
        total_loss = (cfg.ppo_vf_coef * value_loss + kl_coef * kl_divergence_loss
                      + 0.0 * sum(v.sum() for v in out.logits.values()))
    else:
        total_loss = (cfg.ppo_policy_coef * policy_loss + cfg.ppo_vf_coef * value_loss
                      - cfg.entropy_bonus_coef * entropy_bonus + kl_coef * kl_divergence_loss)
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clip_fraction = ((ratio - 1).abs() > cfg.ppo_clip).float().mean()
    return LossTerms(total_loss=total_loss, policy_loss=policy_loss, value_loss=value_loss, entropy_bonus=entropy_bonus,
                     kl_divergence_loss=kl_divergence_loss, approx_kl=approx_kl, clip_fraction=clip_fraction)
