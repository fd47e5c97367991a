"""BaseTrainer/PPOTrainer built with MineStudio's constructor arguments keep every one of them, and
answer to MineStudio's attribute names (no services needed)."""

from __future__ import annotations

import pytest

from overworld.core.config import load_config
from overworld.online import PPOTrainer
from tests.minestudio import fake_policy, minecraft_sim_standin

TRAIN_CONFIG = {  # MineStudio's quick start train_config, as start_trainer passes it: **online_cfg.train_config
    "num_workers": 2, "num_gpus_per_worker": 1.0, "num_iterations": 4000, "vf_warmup": 0, "learning_rate": 0.00002,
    "anneal_lr_linearly": False, "weight_decay": 0.04, "adam_eps": 1e-8, "batch_size_per_gpu": 1,
    "batches_per_iteration": 200, "gradient_accumulation": 10, "epochs_per_iteration": 1, "context_length": 64,
    "discount": 0.999, "gae_lambda": 0.95, "ppo_clip": 0.2, "clip_vloss": False, "max_grad_norm": 5,
    "zero_initial_vf": True, "ppo_policy_coef": 1.0, "ppo_vf_coef": 0.5, "kl_divergence_coef_rho": 0.2,
    "entropy_bonus_coef": 0.0, "coef_rho_decay": 0.9995, "log_ratio_range": 50,
    "normalize_advantage_full_batch": True, "use_normalized_vf": True, "num_readers": 4, "num_cpus_per_reader": 0.1,
    "prefetch_batches": 2, "save_interval": 10, "keep_interval": 40, "record_video_interval": 2,
    "enable_ref_update": True, "resume": None, "resume_optimizer": True, "save_path": "output",
}


def test_minestudios_constructor_arguments_are_all_kept() -> None:
    trainer = PPOTrainer(rollout_manager="127.0.0.1:1", policy_generator=fake_policy.policy_generator,
                         env_generator=minecraft_sim_standin.env_generator, **TRAIN_CONFIG,
                         whole_config="online_dict = {...}")
    t = trainer.config.train_config
    assert t.kl_divergence_coef_rho == 0.2 and trainer.kl_divergence_coef_rho == 0.2  # was silently 0.0
    assert (t.batches_per_iteration, t.context_length, t.use_normalized_vf) == (200, 64, True)
    assert trainer.config.policy_generator == "tests.minestudio.fake_policy:policy_generator"
    assert trainer.policy_generator is fake_policy.policy_generator  # MineStudio calls self.policy_generator()
    assert trainer.fragments_per_iteration == 400 and trainer.num_updates == 0
    assert (trainer.ppo_clip, trainer.learning_rate, trainer.whole_config) == (0.2, 2e-5, "online_dict = {...}")
    trainer.kl_divergence_coef_rho *= 0.5
    assert trainer.rho == 0.1
    with pytest.raises(AttributeError):
        trainer.not_a_key  # noqa: B018


def test_explicit_arguments_win_over_config() -> None:
    config = load_config({"train_config": {"kl_divergence_coef_rho": 0.0, "discount": 0.99}})
    trainer = PPOTrainer("m:1", config=config, kl_divergence_coef_rho=0.2, discount=0.9)
    assert trainer.config.train_config.kl_divergence_coef_rho == 0.2 and trainer.discount == 0.9
    assert PPOTrainer.from_config(config, rollout_manager="m:1").config.train_config.discount == 0.99
