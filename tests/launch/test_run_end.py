"""The end of a budget throws away as little as it can: the workers stop first (finishing the fragments
under way), the learner trains on while the replay buffer holds an iteration's batch, and a trainer then
left waiting for a batch that will not come stops waiting and checkpoints its last iteration. Real
`overworld run`s of examples/cartpole.yaml (one iteration: 8 fragments of 32 steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overworld.trainer.checkpoint import iteration_of
from tests.support import interrupt_run

ROOT = Path(__file__).resolve().parents[2]
ITERATION_STEPS = 8 * 32


@pytest.mark.slow
def test_a_budget_ends_with_what_was_stepped_trained_on(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    # three batches in flight and a slower learner: at the budget the buffer holds more than a batch
    room = ["--set", "rollout_config.replay_buffer_config.samples_per_insert_error=20",
            "--set", "rollout_config.replay_buffer_config.max_staleness=5", "--set", "train_config.epochs_per_iteration=40"]
    result = subprocess.run(
        [sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples" / "cartpole.yaml"), "--insecure",
         "--max-env-steps", "4096", "--summary", str(summary_path), "--workdir", str(tmp_path / "run"), *room],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text(errors="replace")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "max_env_steps", (summary, result.stdout[-2000:])
    left = summary["env_steps_not_trained"]
    # every fragment under way was finished and sent; the learner trained on while the buffer held a
    # batch: at most one (claimed for an iteration the stop cut short, or held below min_size_to_sample)
    # was not trained on
    assert "not_sent" not in left and summary["preempted_env_steps"] == 0, left
    assert left.get("left_in_buffer", 0) + left.get("claimed_not_trained", 0) <= ITERATION_STEPS, left
    # the trainer stopped after its last iteration, or stopped waiting for a batch the stopped fleet
    # would not complete; either way its last checkpoint is of the last iteration it trained
    assert "stop requested" in trainer_log, trainer_log[-3000:]
    assert iteration_of(summary["latest_checkpoint"].rsplit("/", 1)[-1]) == summary["iterations"], summary


@pytest.mark.slow
def test_a_trainer_waiting_for_samples_stops_waiting_when_told(tmp_path: Path) -> None:
    # no rollout worker: the learner waits for its first batch until the run is interrupted
    text = interrupt_run(ROOT / "examples" / "cartpole.yaml", tmp_path / "run", "waiting for data",
                         "--set", "rollout_config.num_rollout_workers=0")
    # without the stop reaching the waiting reader, the learner waited out the driver's 120 s and was cut
    # off without its final checkpoint
    assert "stop requested while waiting for samples: iteration 1 not trained" in text, text[-3000:]
