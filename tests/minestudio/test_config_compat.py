"""Every key MineStudio ships or documents loads with its meaning (no minestudio needed)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from overworld.core import config as config_module
from overworld.core.config import ConfigError, check_generators, from_yaml, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[2]

# MineStudio 1.1.6's minestudio/online/run/config/gate_kl.py, verbatim but for the generators' bodies:
# its imports (minestudio, ray, hydra) are not run to read online_dict.
SHIPPED = '''
from minestudio.utils import get_compute_device
import ray
import hydra


online_dict = {
    "trainer_name": "PPOTrainer",
    "detach_rollout_manager": True,
    "rollout_config": {
        "num_rollout_workers": 2,
        "num_gpus_per_worker": 1.0,
        "num_cpus_per_worker": 1,
        "fragment_length": 256,
        "to_send_queue_size": 8,
        "worker_config": {
            "num_envs": 16,
            "batch_size": 8,
            "restart_interval": 3600,  # 1h
            "video_fps": 20,
            "video_output_dir": "output/videos/gate_kl",
        },
        "replay_buffer_config": {
            "max_chunks": 4800,
            "max_reuse": 2,
            "max_staleness": 2,
            "fragments_per_report": 40,
            "fragments_per_chunk": 1,
            "database_config": {
                "path": "output/replay_buffer_cache",
                "num_shards": 8,
            },
        },
        "episode_statistics_config": {},
    },
    "train_config": {
        "num_workers": 2,
        "num_gpus_per_worker": 1.0,
        "num_iterations": 4000,
        "vf_warmup": 0,
        "learning_rate": 0.00002,
        "anneal_lr_linearly": False,
        "weight_decay": 0.04,
        "adam_eps": 1e-8,
        "batch_size_per_gpu": 1,
        "batches_per_iteration": 200, #200
        "gradient_accumulation": 10,  # TODO: check
        "epochs_per_iteration": 1,  # TODO: check
        "context_length": 64,
        "discount": 0.999,
        "gae_lambda": 0.95,
        "ppo_clip": 0.2,
        "clip_vloss": False,  # TODO: check
        "max_grad_norm": 5,  # ????
        "zero_initial_vf": True,
        "ppo_policy_coef": 1.0,
        "ppo_vf_coef": 0.5,  # TODO: check
        "kl_divergence_coef_rho": 0.2,
        "entropy_bonus_coef": 0.0,
        "coef_rho_decay": 0.9995,
        "log_ratio_range": 50,  # for numerical stability
        "normalize_advantage_full_batch": True,  # TODO: check!!!
        "use_normalized_vf": True,
        "num_readers": 4,
        "num_cpus_per_reader": 0.1,
        "prefetch_batches": 2,
        "save_interval": 10,
        "keep_interval": 40,
        "record_video_interval": 2,
        "enable_ref_update": False,
        "resume": None, #"/scratch/hekaichen/tmpdir/ray/session_2024-12-12_21-10-40_218613_2665801/artifacts/2024-12-12_21-10-58/TorchTrainer_2024-12-12_21-10-58/working_dirs/TorchTrainer_8758b_00000_0_2024-12-12_21-10-58/checkpoints/150",
        "resume_optimizer": True,
        "save_path": "/scratch/hekaichen/workspace/MineStudio/minestudio/online/run/output/gate_kl"
    },

    "logger_config": {
        "project": "minestudio_online",
        "name": "gate_kl"
    },
}

def env_generator():
    from minestudio.simulator import MinecraftSim
    return MinecraftSim(obs_size=(128, 128))

def policy_generator():
    from minestudio.models import load_vpt_policy
    return load_vpt_policy(model_path="x", weights_path="y").to(get_compute_device())
'''


def test_a_shipped_minestudio_config_loads_without_running_its_imports(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gate_kl.py"
    path.write_text(SHIPPED)
    config_module._warned.clear()
    with caplog.at_level(logging.WARNING, "overworld.config"):
        config = load_config(path)
        load_config(path)  # the warning is given once per process
    warnings = [r.getMessage() for r in caplog.records if "enable_ref_update" in r.getMessage()]
    assert len(warnings) == 1 and "never reads" in warnings[0]
    t = config.train_config
    assert (t.kl_divergence_coef_rho, t.record_video_interval, t.resume) == (0.2, 2, None)
    assert config.env_generator == f"{path.resolve()}:env_generator"
    assert config.logger_config.wandb is True  # MineStudio hands logger_config to wandb.init
    assert (config.logger_config.project, config.logger_config.name) == ("minestudio_online", "gate_kl")
    assert from_yaml(to_yaml(config)) == config
    # Where the generators run, their file's import errors are one line, not a traceback.
    with pytest.raises(ConfigError, match=r"^config key env_generator: .*gate_kl\.py:env_generator: "
                                          r"ModuleNotFoundError: No module named '(minestudio|ray)'$"):
        check_generators(config)


def test_an_omegaconf_dictconfig_is_what_minestudio_users_hold() -> None:
    online_cfg = OmegaConf.create({"train_config": {"enable_ref_update": True, "learning_rate": 1e-4,
                                                    "save_path": None},
                                   "logger_config": {"project": "p", "name": "n", "entity": "team",
                                                     "mode": "disabled", "tags": ["a", "b"]},
                                   "rollout_config": {"worker_config": {"max_fast_reset": 50, "log_interval": 30,
                                                                        "moving_stat_duration": 60}}})
    config = load_config(online_cfg)
    assert config.train_config.learning_rate == 1e-4 and config.train_config.save_path is None
    assert config.logger_config.wandb_init == {"entity": "team", "mode": "disabled", "tags": ["a", "b"]}
    wc = config.rollout_config.worker_config
    assert (wc.max_fast_reset, wc.log_interval, wc.moving_stat_duration) == (50, 30, 60)
    assert from_yaml(to_yaml(config)) == config


def test_wandb_is_off_without_logger_config_and_can_be_turned_off() -> None:
    assert load_config({}).logger_config.wandb is False
    assert load_config({"logger_config": {"project": "p", "wandb": False}}).logger_config.wandb is False


def test_episode_statistics_config_takes_what_minestudio_takes() -> None:
    with pytest.raises(ConfigError, match="episode_statistics_config: .*only {} is valid"):
        load_config({"rollout_config": {"episode_statistics_config": {"window": 10}}})


def test_a_config_file_that_fails_to_import_is_one_error_line(tmp_path: Path) -> None:
    bad = tmp_path / "quick.py"
    bad.write_text("import not_a_module_anywhere\nonline_dict = dict(train_config={})\n")
    out = subprocess.run([sys.executable, "-m", "overworld.cli", "run", str(bad), "--workdir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == [f"error: config file {bad}: ModuleNotFoundError: No module named 'not_a_module_anywhere'"]
    # online_dict is a literal, the generator's file fails to import: the same one line, before any service
    literal = tmp_path / "literal.py"
    literal.write_text(textwrap.dedent("""
        import not_a_module_anywhere
        online_dict = {"train_config": {"batches_per_iteration": 1, "gradient_accumulation": 1}}
        def env_generator():
            return None
    """))
    out = subprocess.run([sys.executable, "-m", "overworld.cli", "run", str(literal), "--workdir",
                          str(tmp_path / "w2")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("error: config key env_generator:") and "not_a_module_anywhere" in out.stderr
    assert not (tmp_path / "w2" / "logs").exists()  # nothing was started
