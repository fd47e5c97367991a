"""The trainer through `overworld run` on this CPU machine: asking for a GPU stops the run with an
error that says so (never a silent CPU run, never a restart loop), on Ray Train workers and in Ray
Train's local mode, and a recurrent policy on two trainer workers (DDP, gloo) with a value warm-up
trains to the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cartpole import overworld_processes

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def overworld_run(tmp_path: Path, *overrides: str, timeout: float = 600) -> tuple[dict, subprocess.CompletedProcess]:
    summary_path, workdir = tmp_path / "summary.json", tmp_path / "run"
    sets = [arg for item in overrides for arg in ("--set", item)]
    result = subprocess.run([sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples/cartpole.yaml"), *sets,
                             "--summary", str(summary_path), "--workdir", str(workdir)],
                            capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert summary_path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    assert overworld_processes(workdir) == []
    return json.loads(summary_path.read_text()), result


def test_asking_for_a_gpu_on_a_cpu_machine_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    summary, result = overworld_run(tmp_path, "train_config.num_workers=1", "train_config.num_gpus_per_worker=1",
                                    timeout=300)
    assert result.returncode != 0 and summary["status"] == "failed"
    assert "asks for 1 CPU, 1 GPU; the Ray cluster has" in summary["error"] and " 0 GPU (0 free)" in summary["error"]
    assert summary["restarts"] == {}  # a restart would fail the same way
    assert summary["updates"] == 0


def test_asking_for_a_gpu_in_local_mode_on_a_cpu_machine_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    summary, result = overworld_run(tmp_path, "train_config.num_workers=0", "train_config.num_gpus_per_worker=1",
                                    timeout=300)
    assert result.returncode != 0 and summary["status"] == "failed"
    assert "Ray Train's local mode" in summary["error"] and "CUDA is not usable here" in summary["error"]
    assert summary["restarts"] == {} and summary["updates"] == 0


def test_a_recurrent_policy_on_two_trainer_workers_with_vf_warmup_trains_to_the_end(tmp_path: Path) -> None:
    summary, result = overworld_run(tmp_path, "policy_kwargs.recurrent=true", "train_config.num_workers=2",
                                    "train_config.vf_warmup=2", "train_config.num_iterations=4",
                                    "train_config.epochs_per_iteration=2")
    assert summary["status"] == "completed", (summary, result.stdout[-3000:])
    assert summary["iterations"] == 4 and summary["updates"] == 4 * 2  # 2 epochs of one minibatch
    # version 1 at the start, then one per iteration after the 2 warm-up iterations
    assert summary["model_version"] == 1 + 2
    # the final checkpoint: written by rank 0 with both ranks' RNG states
    assert summary["latest_checkpoint"] == "iter-00000004" and summary["restarts"] == {}
    # Ray Train's PlacementGroupCleaner asks the dashboard every second whether the controller lives; a
    # Ray the driver started has no dashboard, and the cleaner warned every second of the run
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "Ray started in" in trainer_log and "State API may be temporarily unavailable" not in trainer_log
    # Ray's head processes die with the thread that started them: the training thread, which ended with the
    # training, once killed them under the driver, whose stop then hung on the lost GCS and exited 1
    assert "trainer stopped cleanly" in trainer_log and "Failed to connect to GCS" not in trainer_log
