"""PPOTrainer's update without services: the knobs and MineStudio's fixed defects."""

import pytest
import torch

from overworld.policies.base import kl_divergence, log_prob
from overworld.policies.nets import MLPPolicy
from overworld.trainer.loss import LossTerms
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
    trainer.hooks.register("post_loss", lambda t, terms: kls.append(float(terms.kl_divergence_loss.detach())))
    batch = make_batch(trainer, B=8, L=16)
    batch.first[:] = False
    batch.state = {"h": torch.randn(8, trainer.unwrapped_model.core.size)}
    trainer.train_iteration(batch)
    assert len(kls) == 4 and max(kls) < 1e-10  # 2 minibatches x 2 windows of 8 steps


def test_values_are_recomputed_in_bounded_chunks_with_the_state_carried() -> None:
    trainer = make_trainer("policy_kwargs.recurrent=true", "train_config.context_length=4",
                           "train_config.inference_batch_size_per_gpu=2")
    policy = trainer.unwrapped_model
    batch = make_batch(trainer, B=5, L=12, episode_start=7)
    batch.first[:, 0] = False
    batch.state = {"h": torch.randn(5, policy.core.size)}
    seen: list[tuple[int, int]] = []
    handle = policy.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0]["obs"].shape[:2])))
    vpred, next_vpred, logp = trainer.compute_values(batch)
    handle.remove()
    assert max(b for b, _ in seen) == 2 and max(t for _, t in seen) == 4 + 1  # the next observation rides along
    # the same as one pass over each whole chain (MineStudio's inference_batch of everything)
    with torch.no_grad():
        obs = {"obs": torch.cat([batch.obs["obs"], batch.next_obs["obs"]], 1)}
        first = torch.cat([batch.first, torch.zeros(5, 1, dtype=torch.bool)], 1)
        whole, _ = policy(obs, batch.state, first)
    torch.testing.assert_close(vpred, whole.vpred[:, :-1])
    torch.testing.assert_close(next_vpred, whole.vpred[:, -1])
    torch.testing.assert_close(logp, log_prob({k: v[:, :-1] for k, v in whole.logits.items()}, batch.action))


def test_vf_warmup_counts_iterations_and_weights_the_kl_term_by_one() -> None:
    trainer = make_trainer(*BASE, "train_config.vf_warmup=2", "train_config.kl_divergence_coef_rho=0.05")
    seen: list[LossTerms] = []
    trainer.hooks.register("post_loss", lambda t, terms: seen.append(terms))
    cfg = trainer.loss_config
    for iteration, warm in ((1, True), (2, True), (3, False)):
        trainer.iteration = iteration
        trainer.updates = 1000  # optimizer steps do not end the warm-up (they did: 20x too short)
        seen.clear()
        trainer.train_iteration(make_batch(trainer, B=8, L=16, seed=iteration))
        for t in seen:
            if warm:  # MineStudio: value loss + 1.0 * KL
                expected = cfg.ppo_vf_coef * t.value_loss + 1.0 * t.kl_divergence_loss
            else:
                expected = cfg.ppo_policy_coef * t.policy_loss + cfg.ppo_vf_coef * t.value_loss + trainer.rho * t.kl_divergence_loss
            torch.testing.assert_close(t.total_loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
        assert any(float(t.kl_divergence_loss.detach()) > 0 for t in seen[1:])


def test_no_weights_are_published_during_the_value_warmup() -> None:
    from overworld.trainer.builtin_hooks import publish_weights

    trainer = make_trainer("train_config.vf_warmup=2")
    published: list[int] = []
    trainer.broadcast_model_to_rollout_workers = lambda new_version: published.append(trainer.iteration)  # type: ignore[method-assign]
    for iteration in (1, 2, 3, 4):
        trainer.iteration = iteration
        publish_weights(trainer, {})
    assert published == [3, 4]


def test_the_reference_carries_its_own_state_from_window_to_window() -> None:
    # A reference that differs from the policy: window 2's KL must be the one of the reference's
    # own state carried through window 1 (not the policy's, not the recorded one).
    trainer = make_trainer(*BASE, "policy_kwargs.recurrent=true", "train_config.kl_divergence_coef_rho=0.5",
                           "train_config.learning_rate=0.0", "train_config.batches_per_iteration=1",
                           "train_config.batch_size_per_gpu=8", "train_config.gradient_accumulation=1")
    reference = trainer.reference
    assert reference is not None
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.3 * torch.randn_like(p))
    kls: list[float] = []
    trainer.hooks.register("post_loss", lambda t, terms: kls.append(float(terms.kl_divergence_loss.detach())))
    batch = make_batch(trainer, B=8, L=16)
    batch.first[:] = False
    batch.state = {"h": torch.randn(8, trainer.unwrapped_model.core.size)}
    trainer.iteration = 1
    trainer.train_iteration(batch)
    with torch.no_grad():
        policy_out, _ = trainer.unwrapped_model(batch.obs, batch.state, batch.first)
        ref_out, _ = reference(batch.obs, batch.state, batch.first)
        # the batch order was shuffled, but a mean over all chains does not care
        want = [float(kl_divergence({k: v[:, s:s + 8] for k, v in policy_out.logits.items()},
                                    {k: v[:, s:s + 8] for k, v in ref_out.logits.items()}).mean()) for s in (0, 8)]
    assert kls == pytest.approx(want, rel=1e-4)
