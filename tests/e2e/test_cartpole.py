"""The whole loop, every service its own process: CartPole must reach a 100-episode mean return
of 450 within 200,000 env steps (fixed seed), and the run must leave no process behind."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from overworld.launch.milestones import STARTUP_MILESTONES

ROOT = Path(__file__).resolve().parents[2]


def overworld_processes(workdir: Path) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(workdir) in cmdline and "overworld.cli" in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.mark.slow
def test_cartpole_learns_through_all_services(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples/cartpole.yaml"),
         "--max-env-steps", "200000", "--target-return", "450", "--summary", str(summary_path),
         "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert summary_path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "target_reached", (summary, result.stdout[-3000:])
    assert summary["mean_return_last_100"] >= 450
    assert summary["env_steps"] <= 200_000
    assert summary["model_version"] > 1 and summary["updates"] > 0 and summary["episodes"] >= 100
    assert summary["env_steps_per_second"] > 0 and summary["wall_seconds"] > 0
    # what bench/bench_e2e.py reads: every startup milestone, and push latencies on the curve
    assert set(summary["milestones"]) == set(STARTUP_MILESTONES), summary["milestones"]
    curve = [json.loads(line) for line in (workdir / "progress.jsonl").read_text().splitlines()]
    assert any(p.get("registry/push_seconds") for p in curve)
    for name in ("model-registry", "gae", "rollout-manager", "replay-buffer", "trainer", "rollout-worker#0"):
        assert f"  {name}" in result.stdout, f"{name} was not announced"
    assert result.returncode == 0
    assert overworld_processes(workdir) == []
    trainer_log = (workdir / "logs" / "trainer.log").read_text()
    assert "published the starting weights as version 1" in trainer_log
    # examples/cartpole.yaml trains in Ray Train's local mode (num_workers: 0): no Ray processes at all
    assert "Ray Train's local mode" in trainer_log and "Ray started in" not in trainer_log
    assert "not this learner's starting weights" not in trainer_log  # the learner adopted that version
    assert "MineStudio metrics skipped" not in trainer_log  # the trainer may read the buffer's statistics
    # The workers stop after the trainer; their flush gives up after `overworld run`'s 5 s, not the
    # service default of 30 s that every run's end used to wait out for acknowledgements that cannot come
    stopped = re.search(r"rollout-worker stopped cleanly in ([0-9.]+)s",
                        (workdir / "logs" / "rollout-worker#0.log").read_text())
    assert stopped and float(stopped.group(1)) < 20, stopped


@pytest.mark.slow
def test_sigterm_stops_the_run_and_leaves_no_process(tmp_path: Path) -> None:
    import signal
    import time

    from overworld.launch.processes import descendants, proc_stat

    workdir, summary_path = tmp_path / "run", tmp_path / "summary.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples/cartpole.yaml"), "--workdir",
         str(workdir), "--summary", str(summary_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    family: list[tuple[int, str]] = []
    for line in proc.stdout:
        # under way: Ray and env processes exist, and the fleet's steps and fragments are counted (the
        # manager learns the steps from heartbeats, the buffer the fragments from inserts: either may
        # come first, and an update needs the fragments)
        counts = [re.search(rf"{name}\s+([\d,]+)", line) for name in ("env steps", "updates")]
        if all(m and int(m.group(1).replace(",", "")) > 0 for m in counts):
            family = descendants(proc.pid)
            break
        assert time.monotonic() < deadline, "training did not start"
    assert len(family) > 5
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=300)
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "interrupted" and summary["env_steps"] > 0
    assert summary["replay_buffer"]["inserted_fragments"] > 0  # read before the services stopped, as at an end
    time.sleep(1)
    alive = [pid for pid, started in family if (fields := proc_stat(pid)) is not None and fields[19] == started
             and fields[0] != "Z"]
    assert alive == []


@pytest.mark.slow
def test_a_run_that_trains_all_its_iterations_completes_without_a_trainer_restart(tmp_path: Path) -> None:
    """In local mode the trainer exits the moment it finishes; `overworld run` polls its status every
    half second and took a trainer gone before it read "finished" for a crash: it restarted it, and the
    new one resumed from the last checkpoint only to finish again."""
    summary_path, workdir = tmp_path / "summary.json", tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples/cartpole.yaml"), "--set",
         "train_config.num_iterations=5", "--summary", str(summary_path), "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed" and summary["iterations"] == 5, (summary, result.stdout[-3000:])
    assert summary["restarts"] == {}, summary["restarts"]
    assert (workdir / "logs" / "trainer.log").read_text().count("trainer started (pid") == 1
