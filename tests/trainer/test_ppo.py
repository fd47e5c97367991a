"""PPOTrainer's update without services: the knobs and MineStudio's fixed defects."""

import torch

from overworld.policies.nets import MLPPolicy
from tests.trainer.helpers import flat_params, make_batch, make_trainer

BASE = ["train_config.epochs_per_iteration=1", "train_config.batches_per_iteration=2",
        "train_config.batch_size_per_gpu=4", "train_config.context_length=8"]


def test_batch_size_per_gpu_above_one_and_gradient_accumulation() -> None:
    trainer = make_trainer(*BASE)
    before = flat_params(trainer.model)
    metrics = trainer.train_iteration(make_batch(trainer, B=8, L=16))
    assert trainer.updates == 2 and metrics["trainer/skipped_steps"] == 0
    assert not torch.equal(before, flat_params(trainer.model))
    trainer = make_trainer(*BASE, "train_config.gradient_accumulation=2")
    trainer.train_iteration(make_batch(trainer, B=8, L=16))
    assert trainer.updates == 1


def test_optim_steps_per_batch_repeats_the_step() -> None:
    trainer = make_trainer(*BASE, "train_config.optim_steps_per_batch=3")
    trainer.train_iteration(make_batch(trainer, B=8, L=16))
    assert trainer.updates == 6


def test_nan_loss_skips_the_whole_step() -> None:
    trainer = make_trainer(*BASE, "train_config.normalize_advantage_full_batch=false")
    batch = make_batch(trainer, B=8, L=16)
    batch.advantage[0, 0] = float("nan")
    before = flat_params(trainer.model)
    metrics = trainer.train_iteration(batch)
    assert metrics["trainer/skipped_steps"] >= 1
    assert trainer.updates + metrics["trainer/skipped_steps"] == 2
    assert torch.isfinite(flat_params(trainer.model)).all()
    if trainer.updates == 0:
        assert torch.equal(before, flat_params(trainer.model))


def test_value_warmup_trains_the_value_function_only() -> None:
    trainer = make_trainer(*BASE, "train_config.vf_warmup=100")
    policy = trainer.unwrapped_model
    assert isinstance(policy, MLPPolicy)
    actor_before = torch.cat([flat_params(policy.encoder), flat_params(policy.policy_head)])
    value_before = flat_params(policy.value_encoder)
    trainer.train_iteration(make_batch(trainer, B=8, L=16))
    assert torch.equal(actor_before, torch.cat([flat_params(policy.encoder), flat_params(policy.policy_head)]))
    assert not torch.equal(value_before, flat_params(policy.value_encoder))


def test_fix_decoder_freezes_all_but_encoders_and_value_head() -> None:
    trainer = make_trainer(*BASE, "train_config.fix_decoder=true")
    policy = trainer.unwrapped_model
    head_before = flat_params(policy.policy_head)
    trainer.train_iteration(make_batch(trainer, B=8, L=16))
    assert torch.equal(head_before, flat_params(policy.policy_head))
    assert all(p.requires_grad for p in policy.encoder.parameters())


def test_zero_initial_vf() -> None:
    trainer = make_trainer("train_config.zero_initial_vf=true")
    assert float(flat_params(trainer.unwrapped_model.value_head).abs().sum()) == 0.0


def test_recurrent_state_resets_at_an_episode_start_inside_a_fragment() -> None:
    trainer = make_trainer("policy_kwargs.recurrent=true")
    policy = trainer.unwrapped_model
    batch = make_batch(trainer, B=2, L=12, episode_start=5)
    batch.first[:, 0] = False  # the fragment starts mid-episode, with a carried state
    warm = {"h": torch.randn(2, policy.core.size)}
    out, _ = policy(batch.obs, warm, batch.first)
    fresh, _ = policy({"obs": batch.obs["obs"][:, 5:]}, policy.initial_state(2), batch.first[:, 5:])
    torch.testing.assert_close(out.vpred[:, 5:], fresh.vpred)
    assert not torch.allclose(out.vpred[:, :5], policy(batch.obs, policy.initial_state(2), batch.first)[0].vpred[:, :5])


def test_reference_policy_sees_the_same_context() -> None:
    # The reference starts as a copy of the policy. If it saw each window from a zero state while the
    # policy carried its state across windows (MineStudio), the KL of the first step would be > 0.
    trainer = make_trainer(*BASE, "policy_kwargs.recurrent=true", "train_config.kl_divergence_coef_rho=0.5",
                           "train_config.learning_rate=0.0")
    kls: list[float] = []
    trainer.hooks.register("post_loss", lambda t, terms: kls.append(float(terms.kl.detach())))
    batch = make_batch(trainer, B=8, L=16)
    batch.first[:] = False
    batch.state = {"h": torch.randn(8, trainer.unwrapped_model.core.size)}
    trainer.train_iteration(batch)
    assert len(kls) == 4 and max(kls) < 1e-10  # 2 minibatches x 2 windows of 8 steps
