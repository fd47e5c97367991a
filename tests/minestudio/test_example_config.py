"""examples/minecraft_kill_cow.py is a valid overworld config (no minestudio needed to load it)."""

from __future__ import annotations

from pathlib import Path

from overworld.core.config import load_config
from overworld.core.imports import import_object

ROOT = Path(__file__).resolve().parents[2]


def test_quick_start_file_loads_with_minestudio_keys() -> None:
    config = load_config(ROOT / "examples/minecraft_kill_cow.py")
    assert config.env_generator.endswith("minecraft_kill_cow.py:env_generator")
    assert config.policy_generator.endswith("minecraft_kill_cow.py:policy_generator")
    rc, tc = config.rollout_config, config.train_config
    assert (rc.fragment_length, rc.worker_config.num_envs, rc.worker_config.batch_size) == (256, 16, 8)
    assert (tc.kl_divergence_coef_rho, tc.record_video_interval, tc.context_length) == (0.2, 2, 64)
    assert callable(import_object(config.env_generator)) and callable(import_object(config.policy_generator))
