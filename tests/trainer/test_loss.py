"""Each PPO loss term against values computed by hand."""

import math

import pytest
import torch

from overworld.policies.base import PolicyOutput
from overworld.trainer.loss import LossConfig, ppo_loss

CFG = LossConfig(ppo_clip=0.2, clip_vloss=False, ppo_policy_coef=1.0, ppo_vf_coef=0.5,
                 entropy_bonus_coef=0.01, log_ratio_range=50.0)


def output(p_action0: float, vpred: float) -> PolicyOutput:
    logits = torch.log(torch.tensor([[[p_action0, 1 - p_action0]]]))
    return PolicyOutput({"action": logits}, torch.tensor([[vpred]]))


def run(out: PolicyOutput, behaviour_p: float, advantage: float, target: float, old_v: float = 0.0,
        cfg: LossConfig = CFG, ref_p: float | None = None, rho: float = 0.0, value_only: bool = False):
    ref = None if ref_p is None else {"action": torch.log(torch.tensor([[[ref_p, 1 - ref_p]]]))}
    return ppo_loss(out, {"action": torch.tensor([[0]])}, torch.log(torch.tensor([[behaviour_p]])),
                    torch.tensor([[advantage]]), torch.tensor([[target]]), torch.tensor([[old_v]]), ref, rho, cfg,
                    value_only)


def test_policy_term_unclipped_and_clipped() -> None:
    # ratio = 0.55 / 0.5 = 1.1 (inside the clip range): loss = -A * r
    terms = run(output(0.55, 0.0), 0.5, advantage=2.0, target=0.0)
    assert terms.policy_loss.item() == pytest.approx(-2.0 * 1.1, rel=1e-5)
    assert terms.clip_fraction.item() == 0.0
    # ratio = 0.8 / 0.5 = 1.6 with A > 0: clipped at 1.2
    terms = run(output(0.8, 0.0), 0.5, advantage=2.0, target=0.0)
    assert terms.policy_loss.item() == pytest.approx(-2.0 * 1.2, rel=1e-5)
    assert terms.clip_fraction.item() == 1.0
    # ratio 1.6 with A < 0: the pessimistic (unclipped) term wins
    terms = run(output(0.8, 0.0), 0.5, advantage=-1.0, target=0.0)
    assert terms.policy_loss.item() == pytest.approx(1.6, rel=1e-5)


def test_ratio_is_against_the_behaviour_log_prob() -> None:
    same = run(output(0.3, 0.0), 0.3, advantage=1.0, target=0.0)
    assert same.policy_loss.item() == pytest.approx(-1.0, rel=1e-6) and same.approx_kl.item() == pytest.approx(0.0, abs=1e-7)
    stale = run(output(0.3, 0.0), 0.25, advantage=1.0, target=0.0)
    assert stale.policy_loss.item() == pytest.approx(-1.2, rel=1e-5)
    r = 0.3 / 0.25
    assert stale.approx_kl.item() == pytest.approx((r - 1) - math.log(r), rel=1e-4)


def test_log_ratio_is_clamped() -> None:
    cfg = LossConfig(0.2, False, 1.0, 0.5, 0.0, log_ratio_range=0.1)
    terms = run(output(0.9, 0.0), 0.1, advantage=-1.0, target=0.0, cfg=cfg)
    assert terms.policy_loss.item() == pytest.approx(math.exp(0.1), rel=1e-5)


def test_value_entropy_kl_and_total() -> None:
    terms = run(output(0.5, 1.5), 0.5, advantage=0.0, target=0.5, ref_p=0.25, rho=0.2)
    assert terms.value_loss.item() == pytest.approx(0.5 * 1.0**2)
    assert terms.entropy_bonus.item() == pytest.approx(math.log(2), rel=1e-6)
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert terms.kl_divergence_loss.item() == pytest.approx(kl, rel=1e-5)
    expected = 1.0 * terms.policy_loss.item() + 0.5 * 0.5 - 0.01 * math.log(2) + 0.2 * kl
    assert terms.total_loss.item() == pytest.approx(expected, rel=1e-5)


def test_clipped_value_loss() -> None:
    cfg = LossConfig(0.2, True, 1.0, 0.5, 0.0, 50.0)
    # vpred moved from 0 to 1; clipped prediction 0.2; target 1.0: max(0, 0.64) -> 0.5*0.64
    terms = run(output(0.5, 1.0), 0.5, advantage=0.0, target=1.0, old_v=0.0, cfg=cfg)
    assert terms.value_loss.item() == pytest.approx(0.5 * 0.64, rel=1e-5)


def test_value_warmup_has_only_value_and_kl() -> None:
    terms = run(output(0.8, 1.0), 0.5, advantage=3.0, target=0.0, ref_p=0.5, rho=0.1, value_only=True)
    assert terms.total_loss.item() == pytest.approx(0.5 * terms.value_loss.item() + 0.1 * terms.kl_divergence_loss.item(), rel=1e-6)
