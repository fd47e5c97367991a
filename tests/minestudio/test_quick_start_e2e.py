"""The "Done when" of MineStudio compatibility: MineStudio's quick start (docs/source/online/quick-online.md,
online/run/run.py) with its import lines changed to Overworld's runs end to end through every service
(model-registry, gae, rollout-manager, replay-buffer, rollout worker, trainer on Ray) with MineStudio's
real VPTPolicy (random weights, 32 px frames) on a stand-in env speaking MinecraftSim's dictionaries.
Then the detached rollout side is reused by the next script with the same config and restarted by one
with a changed rollout_config. Needs minestudio and ray: `make test-minestudio`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("minestudio", reason="`make test-minestudio` installs minestudio in .venv-minestudio")
pytest.importorskip("ray.train", reason="the trainer runs on Ray Train")

from overworld.online import stop_rolloutmanager  # noqa: E402
from overworld.online.rollout_side import STATE_FILE, read_state  # noqa: E402

pytestmark = [pytest.mark.minestudio, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

QUICK_START = '''
import os
from omegaconf import OmegaConf
from overworld.online import start_rolloutmanager          # was: from minestudio.online.rollout.start_manager import start_rolloutmanager
from overworld.online import start_trainer                 # was: from minestudio.online.trainer.start_trainer import start_trainer
from overworld.online import PPOTrainer                    # was: from minestudio.online.trainer import PPOTrainer


class KillCowTrainer(PPOTrainer):
    """A subclass written against MineStudio's PPOTrainer API."""

    def train_iteration(self):
        result = super().train_iteration()
        self.note(f"train_iteration {self.num_updates} rho {self.kl_divergence_coef_rho:.6f}")
        return result

    def ppo_update(self, records, td_targets, advantages, old_logps, old_vpreds, rewards):
        self.note(f"ppo_update advantages {tuple(advantages.shape)} lr {self.learning_rate} clip {self.ppo_clip}")
        return super().ppo_update(records, td_targets, advantages, old_logps, old_vpreds, rewards)

    def note(self, line):
        with open(os.path.join(os.environ["OVERWORLD_WORKDIR"], "subclass.log"), "a") as f:
            f.write(line + "\\n")

online_dict = {
    "trainer_name": "KillCowTrainer",
    "detach_rollout_manager": True,
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_gpus_per_worker": 0.0,
        "num_cpus_per_worker": 1,
        "fragment_length": FRAGMENT_LENGTH,
        "to_send_queue_size": 6,
        "worker_config": {
            "num_envs": 2,
            "batch_size": 2,
            "restart_interval": 3600,  # 1h
            "video_fps": 20,
            "video_output_dir": "output/videos",
        },
        "replay_buffer_config": {
            "max_chunks": 100,
            "max_reuse": 2,
            "max_staleness": 2,
            "fragments_per_report": 4,
            "fragments_per_chunk": 1,
            "database_config": {
                "path": "output/replay_buffer_cache",
                "num_shards": 8,
            },
        },
        "episode_statistics_config": {},
    },
    "train_config": {
        "num_workers": 1,
        "num_gpus_per_worker": 0.0,
        "num_iterations": 6,
        "vf_warmup": 0,
        "learning_rate": 0.00002,
        "anneal_lr_linearly": False,
        "weight_decay": 0.04,
        "adam_eps": 1e-8,
        "batch_size_per_gpu": 1,
        "batches_per_iteration": 2,
        "gradient_accumulation": 1,
        "epochs_per_iteration": 1,
        "context_length": 16,
        "discount": 0.999,
        "gae_lambda": 0.95,
        "ppo_clip": 0.2,
        "clip_vloss": False,
        "max_grad_norm": 5,
        "zero_initial_vf": True,
        "ppo_policy_coef": 1.0,
        "ppo_vf_coef": 0.5,
        "kl_divergence_coef_rho": 0.2,
        "entropy_bonus_coef": 0.0,
        "coef_rho_decay": 0.9995,
        "log_ratio_range": 50,
        "normalize_advantage_full_batch": True,
        "use_normalized_vf": True,
        "num_readers": 1,
        "num_cpus_per_reader": 0.1,
        "prefetch_batches": 2,
        "save_interval": 1,
        "keep_interval": 40,
        "record_video_interval": 1,
        "enable_ref_update": True,
        "resume": None,
        "resume_optimizer": True,
        "save_path": "output"
    },
    "logger_config": {
        "project": "minestudio_online",
        "name": "kill_cow",
    },
}


def _standin():
    import importlib.util
    spec = importlib.util.spec_from_file_location("standin", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_generator():
    # MinecraftSim's observation and action dictionaries, no engine; steps slow enough that episodes end
    # and are reported (workers heartbeat every 2 s) while the trainer iterates
    return _standin().StandInSim(time_limit=10, step_seconds=0.02)


def policy_generator():
    from minestudio.models import VPTPolicy
    return VPTPolicy(policy_kwargs=_standin().SMALL_VPT)  # the real VPT architecture, random weights


if __name__ == "__main__":
    online_cfg = OmegaConf.create(online_dict)
    start_rolloutmanager(policy_generator, env_generator, online_cfg)
    if TRAIN:
        with open(__file__) as f:
            whole_config = f.read()
        print("RESULT", start_trainer(policy_generator, env_generator, online_cfg, whole_config))
'''


def _run(tmp_path: Path, name: str, fragment_length: int, train: bool) -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(textwrap.dedent(QUICK_START).replace("FRAGMENT_LENGTH", str(fragment_length))
                      .replace("TRAIN", str(train))
                      .replace("STANDIN", repr(str(ROOT / "tests/minestudio/minecraft_sim_standin.py"))))
    env = {**os.environ, "OVERWORLD_WORKDIR": str(tmp_path / "work"), "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT)])}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)


def test_minestudio_quick_start_runs_through_every_service(tmp_path: Path) -> None:
    work = tmp_path / "work"
    try:
        out = _run(tmp_path, "run.py", 16, train=True)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
        assert result and "'state': 'finished'" in result[0] and "'iteration': 6" in result[0], out.stdout[-2000:]
        config = (work / "trainer-config.yaml").read_text()
        run_id = read_state(work)["run_id"]  # type: ignore[index]
        assert "enable_ref_update" not in config and "kl_divergence_coef_rho: 0.2" in config
        checkpoints = work / "output" / run_id / "checkpoints"
        assert (checkpoints / "iter-00000006" / "COMMITTED").exists()
        assert "from overworld.online import start_trainer" in (work / "whole_config.py").read_text()
        # W&B on (logger_config given), offline without a key, with MineStudio's metric names
        runs = list(work.glob("logs/*/wandb/offline-run-*/run-*.wandb"))
        assert len(runs) == 1, sorted(str(p) for p in work.glob("logs/*/wandb/**/*"))
        logged = runs[0].read_bytes()  # W&B's record log: the metric names are plain strings in it
        for key in ("trainer/policy_loss", "trainer/kl_divergence_loss", "trainer/env_steps_all_workers",
                    "trainer/env_SPS_all_workers", "replay_buffer/replay_buffer_size (chunk)",
                    "replay_buffer/model_version", "episode_statistics/4train/sum_reward",
                    "episode_statistics/4train/episode_length", "episode_statistics/step"):
            assert key.encode() in logged, key
        assert "no API key" in (work / "logs" / "trainer.log").read_text()
        # the subclass ran under trainer_name, with MineStudio's method names, arguments and attributes
        calls = (work / "subclass.log").read_text().splitlines()
        assert calls[0].startswith("ppo_update advantages (2, 16) lr 2e-05 clip 0.2"), calls
        assert calls[1] == "train_iteration 1 rho 0.199900" and calls[3] == "train_iteration 2 rho 0.199800", calls

        side = read_state(work)
        again = _run(tmp_path, "run.py", 16, train=False)  # the same script and config: the detached side is reused
        assert again.returncode == 0, again.stderr[-3000:]
        assert "Reusing existing rollout manager" in again.stderr
        assert read_state(work)["pid"] == side["pid"]  # type: ignore[index]
        changed = _run(tmp_path, "run.py", 32, train=False)  # rollout_config changed: restarted
        assert changed.returncode == 0, changed.stderr[-3000:]
        assert "config changed, killing and restarting" in changed.stderr
        assert read_state(work)["pid"] != side["pid"]  # type: ignore[index]
    finally:
        stop_rolloutmanager(work)
    assert not (work / STATE_FILE).exists()
