"""The GPU check's Crafter step: the published ResNet-PPO recipe (examples/crafter_resnet.yaml) through
`overworld run`, for as long as the call has left, run by bench/gpu/check.py in a child process:

    python -m bench.gpu.crafter --stop-at UNIX_TIME --until UNIX_TIME --result PATH

Nothing of the run can come back for a later call (the box is gone 30 s after it, and its ~32 MB
checkpoint is over $OUT's 16 MiB a file), so the step measures what one call can: throughput in env
steps/s, the learner's seconds per iteration and the Crafter score so far, read off the run's learning
curve (progress.jsonl) and written to PATH every few seconds. At --stop-at the run is stopped as Ctrl-C
stops it (its summary adds the achievements' success rates); 4 s before --until, the step's end, it is
killed whatever it is doing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.outbox import read_json, write_json
from bench.gpu.plan import ROOT, WORKDIR, stand_in
from bench.gpu.probe import device_stamp

RECIPE = "examples/crafter_resnet.yaml"
KILL_BEFORE_END = 4.0  # seconds: the run is killed this long before the step's end, for the last figures
BENCHMARK_ENV_STEPS = 1_000_000  # per seed; the run is stopped by the clock long before
STAND_IN_SETS = ["train_config.num_gpus_per_worker=0", "rollout_config.num_gpus_per_worker=0",
                 "rollout_config.worker_config.device=cpu", "rollout_config.worker_config.num_envs=4",
                 "rollout_config.worker_config.batch_size=2", "rollout_config.worker_config.num_env_processes=2",
                 "rollout_config.fragment_length=16", "train_config.context_length=16",
                 "train_config.batch_size_per_gpu=2", "train_config.batches_per_iteration=2",
                 "rollout_config.replay_buffer_config.min_size_to_sample=4",
                 "rollout_config.replay_buffer_config.samples_per_insert_error=4",
                 "policy_kwargs.channels=[8,16,16]", "policy_kwargs.dense=32", "policy_kwargs.hidden=64",
                 # an iteration here is 64 env steps, not the recipe's 4,096: its 250 would end the run
                 # before the clock does (100 s once workers stopped idling on a full buffer)
                 "train_config.num_iterations=1000000"]


class Stopped(Exception):
    """The supervisor ended this step early (SIGTERM)."""


def read_curve(path: Path) -> list[dict[str, Any]]:
    """progress.jsonl's points; a last line still being written is left out."""
    points = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            points.append(json.loads(line))
        except ValueError:
            continue
    return points


def curve_figures(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput, learner time and score from the learning curve (a point every 2 s of the run)."""
    stepping = [p for p in curve if p.get("env_steps", 0) > 0]
    if not stepping:
        return {"env_steps": 0, "wall_seconds": curve[-1]["wall_seconds"] if curve else None}
    first, last = stepping[0], curve[-1]
    span = last["wall_seconds"] - first["wall_seconds"]
    per_iteration = {p["iteration"]: p["trainer/iteration_seconds"] for p in curve if "trainer/iteration_seconds" in p}
    parts = sorted({k for p in curve for k in p if k.startswith("trainer/") and k.endswith("_seconds")})
    return {
        "env_steps": last["env_steps"], "episodes": last.get("episodes"), "iterations": last.get("iteration"),
        "updates": last.get("updates"), "model_version": last.get("model_version"),
        "wall_seconds": last["wall_seconds"],
        # the run's start to its first env steps: services, env processes, the first weights (at 2 s steps)
        "startup_seconds": first["wall_seconds"],
        # while stepping: the rollout and the learner together, the rate limiter holding them in step
        "env_steps_per_second": round((last["env_steps"] - first["env_steps"]) / span, 1) if span > 0 else None,
        "learner_seconds_per_iteration": round(statistics.median(per_iteration.values()), 3) if per_iteration else None,
        "learner_iterations_sampled": len(per_iteration),
        "learner_parts_seconds": {k.removeprefix("trainer/").removesuffix("_seconds"):
                                  round(statistics.median(p[k] for p in curve if k in p), 4) for k in parts},
        "score": last.get("crafter/crafter_score"),
        "mean_return_last_100": last.get("mean_return_last_100"),
    }


def summary_figures(summary: dict[str, Any] | None) -> dict[str, Any]:
    if not summary:
        return {}
    crafter = ((summary.get("tasks") or {}).get("crafter") or {}).get("crafter") or {}
    return {"status": summary.get("status"), "env_steps": summary.get("env_steps"),
            "wall_seconds": summary.get("wall_seconds"), "env_steps_per_second": summary.get("env_steps_per_second"),
            "score": crafter.get("score"), "episodes_scored": crafter.get("episodes"),
            "success_rates": crafter.get("success_rates")}


def stop(proc: subprocess.Popen[bytes], sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--result", required=True, type=Path)
    p.add_argument("--stop-at", required=True, type=float, help="unix time: stop the run as Ctrl-C does")
    p.add_argument("--until", required=True, type=float, help="unix time the supervisor stops this step at")
    args = p.parse_args(argv)
    kill_at = args.until - KILL_BEFORE_END

    def on_term(_signum: int, _frame: object) -> None:
        raise Stopped

    signal.signal(signal.SIGTERM, on_term)
    tiny = stand_in()
    workdir = ROOT / WORKDIR / "crafter"
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run: nothing resumes across calls
    workdir.mkdir(parents=True)
    sets = ["seed=0", "logger_config.wandb=false", *(STAND_IN_SETS if tiny else [])]
    cmd = [sys.executable, "-m", "overworld.cli", "run", str(ROOT / RECIPE), "--workdir", str(workdir),
           "--summary", str(workdir / "summary.json"), "--max-env-steps", str(BENCHMARK_ENV_STEPS),
           *[x for s in sets for x in ("--set", s)]]
    launched = time.time()
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, process_group=0,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result: dict[str, Any] = {"step": "crafter", "status": "running", "complete": False, "config": RECIPE,
                              "overrides": sets, "planned_seconds": round(args.stop_at - launched, 1)}
    result["on"] = device_stamp()  # torch imported while the run starts
    poll = 2.0 if tiny else 5.0
    stopped_by = None
    try:
        while proc.poll() is None:
            now = time.time()
            if now >= kill_at:
                stopped_by = "killed at the call's end"
                break
            if now >= args.stop_at and stopped_by is None:
                stopped_by = "stopped at the call's planned end"
                stop(proc, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(poll, max(0.1, kill_at - now)))
            result.update(curve_figures(read_curve(workdir / "progress.jsonl")))
            result["seconds_since_launch"] = round(time.time() - launched, 1)
            write_json(args.result, result)
            print(f"crafter: {result['env_steps']:,} env steps, {result.get('env_steps_per_second')} /s, "
                  f"learner {result.get('learner_seconds_per_iteration')} s/iteration, score {result.get('score')}",
                  flush=True)
    except Stopped:
        stopped_by = "stopped by the check's supervisor"
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGKILL, group=True)
            proc.wait()
    result.update(curve_figures(read_curve(workdir / "progress.jsonl")))
    result["summary"] = summary_figures(read_json(workdir / "summary.json"))
    if (result["summary"].get("env_steps") or 0) > result["env_steps"]:  # counted at the stop, after the curve's last point
        result.update(env_steps=result["summary"]["env_steps"], score=result["summary"]["score"])
    result.update(stopped_by=stopped_by or f"the run ended by itself (exit {proc.returncode})",
                  run_exit_code=proc.returncode, seconds_since_launch=round(time.time() - launched, 1),
                  complete=result["env_steps"] > 0)
    write_json(args.result, result)
    return 0 if result["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
