"""The PPO loss of MineStudio's PPOTrainer, term by term, with its defects fixed.

Ratios are taken against the behaviour log-probs recorded at rollout time (MineStudio recomputed
them with the learner, so stale fragments were never corrected for).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor
    approx_kl: torch.Tensor
    clip_fraction: torch.Tensor


def ppo_loss(out: PolicyOutput, action: dict[str, torch.Tensor], behaviour_logp: torch.Tensor,
             advantage: torch.Tensor, target_vpred: torch.Tensor, old_vpred: torch.Tensor,
             ref_logits: dict[str, torch.Tensor] | None, kl_coef: float, cfg: LossConfig,
             value_only: bool = False) -> LossTerms:
    """All inputs are (B, T); `target_vpred` and `old_vpred` are in the value head's (normalised) space.
    `kl_coef`: the weight of KL(pi || reference), rho (MineStudio: 1 during the value warm-up).

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

    ent = entropy(out.logits).mean()
    kl = kl_divergence(out.logits, ref_logits).mean() if ref_logits is not None else torch.zeros((), device=vpred.device)
    if value_only:
        total = cfg.ppo_vf_coef * value_loss + kl_coef * kl + 0.0 * sum(v.sum() for v in out.logits.values())
    else:
        total = (cfg.ppo_policy_coef * policy_loss + cfg.ppo_vf_coef * value_loss
                 - cfg.entropy_bonus_coef * ent + kl_coef * kl)
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clip_fraction = ((ratio - 1).abs() > cfg.ppo_clip).float().mean()
    return LossTerms(total, policy_loss, value_loss, ent, kl, approx_kl, clip_fraction)
