"""The end of a budget throws away as little as it can: the workers stop first (finishing the fragments
under way), the learner trains on while the replay buffer holds an iteration's batch, and a trainer then
left waiting for a batch that will not come stops waiting and checkpoints its last iteration. A real
`overworld run` of examples/cartpole.yaml (one iteration: 8 fragments of 32 steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overworld.trainer.checkpoint import iteration_of

ROOT = Path(__file__).resolve().parents[2]
ITERATION_STEPS = 8 * 32


@pytest.mark.slow
def test_a_budget_ends_with_what_was_stepped_trained_on(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples" / "cartpole.yaml"), "--insecure",
         "--max-env-steps", "4096", "--summary", str(summary_path), "--workdir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text(errors="replace")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "max_env_steps", (summary, result.stdout[-2000:])
    left = summary["env_steps_not_trained"]
    # every fragment under way was finished and sent; less than one iteration's batch was not trained on
    assert "not_sent" not in left and summary["preempted_env_steps"] == 0, left
    assert left.get("left_in_buffer", 0) + left.get("claimed_not_trained", 0) < ITERATION_STEPS, left
    # the fleet stopped first: the trainer was left waiting for a batch, stopped waiting, and its last
    # checkpoint is of the last iteration it trained
    assert "stop requested while waiting for samples" in trainer_log, trainer_log[-3000:]
    assert iteration_of(summary["latest_checkpoint"].rsplit("/", 1)[-1]) == summary["iterations"], summary
