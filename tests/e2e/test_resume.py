"""Kill the trainer mid-run: it comes back and resumes from its latest checkpoint by itself. Then
resume the finished run with `--resume latest`: env steps, model version and KL coefficient continue
from the checkpoint."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overworld.core.blobs.store import LocalBlobStore
from overworld.trainer.checkpoint import CheckpointStore, iteration_of

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["--set", "train_config.save_interval=5", "--set", "train_config.kl_divergence_coef_rho=0.1",
            "--set", "train_config.coef_rho_decay=0.99"]


def command(workdir: Path, summary: Path, max_env_steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples/cartpole.yaml"), *SETTINGS,
            "--max-env-steps", str(max_env_steps), "--workdir", str(workdir), "--summary", str(summary), *extra]


def checkpoints(workdir: Path) -> CheckpointStore:
    run_id = next(line.split(":", 1)[1].strip() for line in (workdir / "config.yaml").read_text().splitlines()
                  if line.startswith("run_id:"))
    return CheckpointStore(LocalBlobStore(workdir / "output"), prefix=f"{run_id}/checkpoints")


@pytest.mark.slow
def test_trainer_restart_and_resume_continue_from_the_checkpoint(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    first = tmp_path / "first.json"
    proc = subprocess.Popen(command(workdir, first, 20_000), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    output = []
    trainer_pid = None
    while trainer_pid is None:
        line = proc.stdout.readline()
        assert line, "".join(output)
        output.append(line)
        if match := re.match(r"\s+trainer\s+\S+\s+pid (\d+)", line):
            trainer_pid = int(match.group(1))
    deadline = time.monotonic() + 300
    killed_after = None
    while time.monotonic() < deadline:
        if (workdir / "config.yaml").exists():
            ids = checkpoints(workdir).list()
            if ids and iteration_of(ids[-1]) >= 10:
                killed_after = ids[-1]
                killed_state = checkpoints(workdir).load(killed_after, []).state
                os.kill(trainer_pid, signal.SIGKILL)
                break
        time.sleep(0.5)
    assert killed_after, "no checkpoint at iteration >= 10 within 300 s"
    rest, _ = proc.communicate(timeout=900)
    output.append(rest)
    summary = json.loads(first.read_text())
    assert summary["status"] == "max_env_steps", "".join(output)[-4000:]
    assert summary["restarts"] == {"trainer": 1}
    assert summary["resumed_from"] is not None  # the restarted trainer found its checkpoint by itself
    assert summary["model_version"] > killed_state["model_version"]

    store = checkpoints(workdir)
    latest = store.resolve("latest")
    state = store.load(latest, []).state
    # the checkpoint the run stopped at counts every env step the fleet stepped before the stop (not
    # those of the last iteration's start): a resumed budget goes on from where the run stopped
    assert state["env_steps"] >= 20_000, (state["env_steps"], summary["env_steps"])
    second = tmp_path / "second.json"
    result = subprocess.run(command(workdir, second, state["env_steps"] + 6_000, "--resume", "latest"),
                            capture_output=True, text=True, timeout=900)
    resumed = json.loads(second.read_text())
    assert resumed["status"] == "max_env_steps", result.stdout[-4000:]
    assert resumed["resumed_from"] == latest
    assert resumed["start_env_steps"] == state["env_steps"] > 0
    assert resumed["start_model_version"] == state["model_version"] > 1
    assert resumed["start_rho"] == pytest.approx(state["rho"]) and state["rho"] < 0.1
    assert resumed["env_steps"] >= state["env_steps"] + 6_000
    # the rate counts this run's steps only, not those it started from
    assert resumed["env_steps_per_second"] == pytest.approx(
        (resumed["env_steps"] - resumed["start_env_steps"]) / resumed["wall_seconds"], rel=0.01)
    assert resumed["model_version"] > state["model_version"]
    assert resumed["iterations"] > state["iteration"]
