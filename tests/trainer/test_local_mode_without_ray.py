"""`train_config.num_workers: 0` trains without Ray: the whole pipeline (`overworld run`) trains, and the
trainer process never imports `ray`, from its start to its exit (the driver's stop included), so that a
machine without Ray (a GPU workstation, the GPU check's box) runs it. `num_workers >= 1`
keeps Ray Train (tests/e2e/test_trainer_placement.py, tests/trainer/test_ddp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "trainer" / "module_probe.py"


@pytest.mark.slow
def test_local_mode_trains_and_never_imports_ray(tmp_path: Path) -> None:
    probe_out = tmp_path / "modules.jsonl"
    summary_path = tmp_path / "summary.json"
    # examples/cartpole.yaml has num_workers: 0; 1,536 env steps are 6 iterations of 256
    result = subprocess.run(
        [sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples" / "cartpole.yaml"), "--insecure",
         "--max-env-steps", "1536", "--summary", str(summary_path), "--workdir", str(tmp_path / "run"),
         "--set", "train_config.num_workers=0", "--set", f"train_config.hooks=[{PROBE}:install]"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OVERWORLD_MODULE_PROBE": str(probe_out)})
    trainer_log = (tmp_path / "run" / "logs" / "trainer.log").read_text(errors="replace")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] in ("max_env_steps", "completed"), (summary, result.stdout[-2000:], trainer_log[-3000:])
    assert summary["updates"] > 0 and summary["model_version"] > 1
    entries = [json.loads(line) for line in probe_out.read_text().splitlines()]
    wheres = [e["where"] for e in entries]
    assert "post_iteration" in wheres and wheres[-1] == "exit", wheres  # the exit record: after the driver stopped
    assert len({e["pid"] for e in entries}) == 1  # all from the one trainer process (it was never restarted)
    for entry in entries:
        assert entry["world_size"] == 1 and entry["device"] == "cpu"
        assert "ray" not in entry["modules"], f"the trainer imported ray ({entry['where']}, iteration {entry['iteration']})"
    # the learning-rate schedule, stepped by the loop after each iteration: 1e-3 annealed over 1,000 iterations
    rates = {e["iteration"]: e["learning_rate"] for e in entries if e["where"] == "post_iteration"}
    assert rates == {i: pytest.approx(1e-3 * (1 - i / 1000), rel=1e-9) for i in range(1, len(rates) + 1)}, rates
    assert "torch" in entries[-1]["modules"] and "overworld" in entries[-1]["modules"]  # the probe sees imports
    assert "Ray started in" not in trainer_log and "stopped cleanly" in trainer_log
