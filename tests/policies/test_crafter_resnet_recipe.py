"""examples/crafter_resnet.yaml is the published ResNet-PPO of Moon et al. 2023 (snu-mllab/
Achievement-Distillation, "PPO"), point by point: every hyperparameter of its configs/ppo.yaml and
algorithm code, and a network with exactly the parameters of its PPOModel.

The recipe below is transcribed from that repository at commit 9abbce6 (configs/ppo.yaml and
achievement_distillation/*.py); the parameter counts were computed from its PPOModel built with
those model_kwargs on Crafter's (3, 64, 64) frames and 17 actions."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from overworld.core.config import load_config
from overworld.policies.base import PolicyOutput
from overworld.policies.factory import build_policy, describe_env
from overworld.policies.impala import ImpalaPolicy, NormedUnit
from overworld.trainer.learner import PPOLearner
from overworld.trainer.loss import LossConfig, ppo_loss

ROOT = Path(__file__).resolve().parents[2]

# configs/ppo.yaml
AD_PPO_YAML = {
    "nstep": 512, "nproc": 8, "nepoch": 250, "gamma": 0.95, "gae_lambda": 0.65,
    "model_kwargs": {"hidsize": 1024, "impala_kwargs": {
        "chans": [64, 128, 128], "outsize": 256, "nblock": 2, "post_pool_groups": 1,
        "init_norm_kwargs": {"batch_norm": False, "group_norm_groups": 1}},
        "dense_init_norm_kwargs": {"layer_norm": True}},
    "algorithm_kwargs": {"ppo_nepoch": 3, "ppo_nbatch": 8, "clip_param": 0.2, "vf_loss_coef": 0.5,
                         "ent_coef": 0.01, "lr": 3.0e-4, "max_grad_norm": 0.5},
}
# From the code: torch.optim.Adam(params, lr) (eps 1e-8, no weight decay, no schedule); NormalizeEwma
# beta 0.99, moved on every minibatch; advantages normalised over the whole rollout; no value clipping.
AD_ADAM_EPS = 1e-8
AD_VALUE_NORM_BETA = 0.99
# sum(p.numel() for p in PPOModel(...).parameters()): 3,948,306 trainable + NormalizeEwma's running_mean,
# running_mean_sq and debiasing_term, held as frozen nn.Parameters (3 numbers). Overworld keeps those three
# as the ValueNormalizer's buffers (mean, mean_sq, debias), so the trainable counts must be equal and the
# normaliser must hold 3 numbers.
AD_PARAMETERS_TOTAL = 3_948_309
AD_PARAMETERS_TRAINABLE = 3_948_306
AD_PARAMETERS_BY_PART = {"enc.stacks": 1_553_664, "enc.dense": 2_113_536, "linear": 262_656,
                         "pi_head": 17_425, "vf_head.linear": 1_025}


@pytest.fixture(scope="module")
def config():
    return load_config(ROOT / "examples" / "crafter_resnet.yaml")


@pytest.fixture(scope="module")
def policy(config) -> ImpalaPolicy:
    obs_space, act_space = describe_env(config)
    torch.manual_seed(0)
    built = build_policy(config, obs_space, act_space)
    assert isinstance(built, ImpalaPolicy)
    return built


def test_rollout_and_update_sizes_are_the_recipes(config) -> None:
    rc, t = config.rollout_config, config.train_config
    envs = rc.num_rollout_workers * rc.worker_config.num_envs
    assert envs == AD_PPO_YAML["nproc"]
    steps_per_iteration = t.batch_size_per_gpu * t.batches_per_iteration * rc.fragment_length
    assert steps_per_iteration == AD_PPO_YAML["nproc"] * AD_PPO_YAML["nstep"]  # 4,096 env steps per update
    assert steps_per_iteration // envs == AD_PPO_YAML["nstep"]
    a = AD_PPO_YAML["algorithm_kwargs"]
    assert t.batches_per_iteration == a["ppo_nbatch"] and t.gradient_accumulation == 1  # a step per minibatch
    assert t.batch_size_per_gpu * rc.fragment_length == AD_PPO_YAML["nproc"] * AD_PPO_YAML["nstep"] // a["ppo_nbatch"]
    assert t.epochs_per_iteration == a["ppo_nepoch"]
    assert t.num_iterations == AD_PPO_YAML["nepoch"] and t.num_workers == 0 and t.num_gpus_per_worker > 0
    # on-policy: every fragment is used in exactly one iteration
    assert rc.replay_buffer_config.max_reuse == 1 and rc.replay_buffer_config.samples_per_insert == 1.0
    assert rc.replay_buffer_config.min_size_to_sample == t.batch_size_per_gpu * t.batches_per_iteration


def test_algorithm_hyperparameters_are_the_recipes(config) -> None:
    t, a = config.train_config, AD_PPO_YAML["algorithm_kwargs"]
    assert (t.discount, t.gae_lambda) == (AD_PPO_YAML["gamma"], AD_PPO_YAML["gae_lambda"])
    assert t.ppo_clip == a["clip_param"] and not t.clip_vloss
    assert t.entropy_bonus_coef == a["ent_coef"] and t.max_grad_norm == a["max_grad_norm"]
    assert t.learning_rate == a["lr"] and not t.anneal_lr_linearly
    assert t.weight_decay == 0.0 and t.adam_eps == AD_ADAM_EPS
    assert t.ppo_policy_coef == 1.0 and t.kl_divergence_coef_rho == 0.0 and t.max_grad_value is None
    assert t.normalize_advantage_full_batch and t.use_normalized_vf and not t.zero_initial_vf
    assert not t.use_amp and t.vf_warmup == 0 and t.optim_steps_per_batch == 1


def test_value_loss_weight_is_the_recipes(config) -> None:
    """AD's loss is pi_loss + vf_loss_coef * MSE; Overworld's value term is ppo_vf_coef * 0.5 * MSE
    (trainer/loss.py): the weights on the squared error must be the same."""
    t = config.train_config
    cfg = LossConfig(t.ppo_clip, t.clip_vloss, t.ppo_policy_coef, t.ppo_vf_coef, 0.0, t.log_ratio_range)
    g = torch.Generator().manual_seed(0)
    vpred, target = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    logits = {"action": torch.zeros(4, 8, 17)}
    action = {"action": torch.zeros(4, 8, dtype=torch.long)}
    logp = torch.full((4, 8), -math.log(17))
    terms = ppo_loss(PolicyOutput(logits, vpred), action, logp, torch.zeros(4, 8), target, vpred, None, 0.0, cfg)
    mse = ((vpred - target) ** 2).mean()
    assert float(terms.total_loss) == pytest.approx(AD_PPO_YAML["algorithm_kwargs"]["vf_loss_coef"] * float(mse), rel=1e-6)


def test_value_normaliser_moves_per_iteration_as_ads_per_minibatch(config, policy) -> None:
    """Updated once per iteration, its decay must be AD's per-minibatch 0.99 over the iteration's 24 minibatches."""
    t = config.train_config
    minibatches = t.epochs_per_iteration * t.batches_per_iteration
    assert policy.value_normalizer.enabled
    assert policy.value_normalizer.beta == pytest.approx(AD_VALUE_NORM_BETA ** minibatches, rel=1e-12)


def test_network_is_ads_ppo_model(config, policy) -> None:
    kw = config.policy_kwargs
    m = AD_PPO_YAML["model_kwargs"]
    assert kw["channels"] == m["impala_kwargs"]["chans"] and kw["blocks"] == m["impala_kwargs"]["nblock"]
    assert kw["dense"] == m["impala_kwargs"]["outsize"] and kw["hidden"] == m["hidsize"]
    assert kw["norm"] is True and kw["recurrent"] is False
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert trainable == AD_PARAMETERS_TRAINABLE
    normaliser = sum(b.numel() for b in policy.value_normalizer.buffers())
    assert trainable + normaliser == AD_PARAMETERS_TOTAL
    conv, dense, hidden = policy.encoder
    parts = {"enc.stacks": conv, "enc.dense": dense, "linear": hidden, "pi_head": policy.policy_head,
             "vf_head.linear": policy.value_head}
    assert {k: sum(p.numel() for p in v.parameters()) for k, v in parts.items()} == AD_PARAMETERS_BY_PART


def test_norms_and_initialisation_are_ads(policy) -> None:
    """One-group GroupNorms: after each of the 3 pools, before the first conv of stacks 2 and 3 and before
    each of the 12 block convolutions (17); LayerNorm before both dense layers; only the very first
    convolution (no norm before it) and the heads have biases. Fan-in init: every output unit's weights
    have the norm AD gives them."""
    modules = list(policy.modules())
    group = [m for m in modules if isinstance(m, nn.GroupNorm)]
    assert len(group) == 17 and all(m.num_groups == 1 for m in group)
    assert [m.normalized_shape for m in modules if isinstance(m, nn.LayerNorm)] == [(8192,), (256,)]
    biased = [m for m in modules if isinstance(m, nn.Conv2d | nn.Linear) and m.bias is not None]
    assert len(biased) == 3  # the first conv, the policy head, the value head
    units = [m for m in modules if isinstance(m, NormedUnit)]
    block_scale = math.sqrt((1 / math.sqrt(3)) / math.sqrt(2))  # AD: stack 1/sqrt(3 stacks), blocks 1/sqrt(2)
    expected = []
    for _ in range(3):
        expected += [1.0] + [block_scale] * 4  # the stack's conv, then 2 blocks x 2 convs
    expected += [1.4, 1.0]  # dense (ImpalaCNN's, init_scale 1.4), then PPOModel.linear
    assert len(units) == len(expected)
    for unit, scale in zip(units, expected, strict=True):
        norms = unit.layer.weight.detach().flatten(1).norm(dim=1)
        assert torch.allclose(norms, torch.full_like(norms, scale), rtol=1e-5), (unit, scale)
    # heads: orthogonal, gains 0.01 (CategoricalActionHead) and 0.1 (ScaledMSEHead): rows of that norm
    for head, gain in ((policy.policy_head["action"], 0.01), (policy.value_head, 0.1)):
        norms = head.weight.detach().norm(dim=1)
        assert torch.allclose(norms, torch.full_like(norms, gain), rtol=1e-5) and not head.bias.any()


def test_it_acts_on_crafter_frames_and_the_trainer_builds_ads_optimizer(config) -> None:
    trainer = PPOLearner.from_config(config, rollout_manager="")
    model, optimizer = trainer.setup_model_and_optimizer()
    group = optimizer.param_groups[0]
    assert (group["lr"], group["eps"], group["weight_decay"]) == (3e-4, AD_ADAM_EPS, 0.0)
    frames = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 3, 64, 64, 3), dtype=np.uint8))
    out, state = model({"obs": frames}, model.initial_state(2), torch.zeros(2, 3, dtype=torch.bool))
    assert out.logits["action"].shape == (2, 3, 17) and out.vpred.shape == (2, 3) and state == {}
