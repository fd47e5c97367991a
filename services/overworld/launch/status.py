"""`overworld status`: the fleet as the rollout-manager sees it, and, for a run started by
`overworld run` (`--workdir`), every service of the run with its restarts and the run's status file.

`<workdir>/status.json` is the run's progress as data, rewritten by `overworld run` at every progress
tick and at its end: its state, the latest figures (env steps, iteration, return, model version, the
budget and the time left) and its startup milestones (unix times). Scripts and benchmarks read it (or
the summary, which holds the same milestones) instead of the printed lines or the services' logs."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from overworld.core.security import tls
from overworld.launch.restarts import read_services
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.v1 import rollout_manager_pb2 as pb

RUN_STATUS_FILE = "status.json"


def write_run_status(workdir: Path, status: dict[str, Any]) -> None:
    """`<workdir>/status.json`, replaced atomically (a reader never sees half a file)."""
    path = workdir / RUN_STATUS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**status, "updated_unix": round(time.time(), 3)}, indent=1))
    os.replace(tmp, path)


def read_run_status(workdir: str | Path) -> dict[str, Any]:
    """The status file of the run in `workdir` (FileNotFoundError before its first tick)."""
    return json.loads((Path(workdir) / RUN_STATUS_FILE).read_text())


def format_run_status(status: dict[str, Any]) -> str:
    """One line: the run's state and where it stands against its budget."""
    p = status.get("progress") or {}
    budget = status.get("budget") or {}
    ret = p.get("mean_return_last_100")
    left = p.get("seconds_left")
    return (f"run {status.get('run_id')}: {status.get('state')}, {p.get('env_steps', 0):,}"
            + (f"/{budget['max_env_steps']:,}" if budget.get("max_env_steps") else "")
            + f" env steps, iteration {p.get('iteration', 0):,}"
            + (f"/{budget['iterations']:,}" if budget.get("iterations") else "")
            + f", return(100) {'n/a' if ret is None else f'{ret:.2f}'}"
            + (f"/{budget['target_return']:g}" if budget.get("target_return") is not None else "")
            + (f", about {left:.0f}s left" if left is not None else ""))


def format_status(fleet: pb.FleetStatus, videos: list[pb.VideoInfo] | None = None) -> str:
    lines = [f"run {fleet.run_id}: {len(fleet.workers)} workers, {fleet.env_steps:,} env steps, "
             f"{fleet.episodes} episodes, mean return (last 100) {fleet.mean_return_last_100:.2f}, "
             f"{fleet.fragments_sent:,} fragments acknowledged, {fleet.fragments_lost} lost, "
             f"{fleet.preempted_env_steps:,} env steps thrown away by stopping workers"]
    header = (f"{'worker':<12} {'address':<21} {'host':<16} {'envs':>7} {'steps/s':>8} {'env steps':>12} "
              f"{'fragments':>9} {'dropped':>7} {'queue':>5} {'model':>6} {'heartbeat':>9}  restarts")
    lines.append(header)
    for w in fleet.workers:
        restarts = ",".join(f"{k}={v}" for k, v in sorted(w.env_restarts.items())) or "-"
        envs = f"{w.envs_ready}/{w.num_envs}"
        lines.append(f"{w.worker_id:<12} {w.address[:21]:<21} {w.hostname[:16]:<16} {envs:>7} "
                     f"{w.env_steps_per_second:>8.0f} {w.env_steps:>12,} {w.fragments_sent:>9} "
                     f"{w.fragments_dropped:>7} {w.send_queue_depth:>5} {w.model_version:>6} "
                     f"{w.seconds_since_heartbeat:>8.1f}s  {restarts}")
    for t in fleet.tasks:
        extras = "  ".join(f"{k}={v:.2f}" for k, v in sorted(t.mean_extras_last_100.items()))
        lines.append(f"task {t.task}: {t.episodes} episodes, return {t.mean_return_last_100:.2f}, "
                     f"discounted {t.mean_discounted_return_last_100:.2f}, length {t.mean_length_last_100:.0f}"
                     + (f"\n  {extras}" if extras else ""))
    if fleet.videos or fleet.pending_video_requests:
        lines.append(f"videos: {fleet.videos} stored, {fleet.pending_video_requests} requested")
    for v in (videos or [])[-5:]:
        lines.append(f"  {v.key}  return {v.sum_reward:.2f}  length {v.length}  model v{v.model_version}")
    return "\n".join(lines)


def format_services(services: dict[str, Any]) -> str:
    """The services of an `overworld run` (its services.json) with their restarts."""
    lines = [f"{'service':<18} {'address':<21} {'pid':>8} {'restarts':>8}  log"]
    for name, s in sorted(services["services"].items()):
        state = "" if s["exit_code"] is None else f"  (exited {s['exit_code']})"
        lines.append(f"{name:<18} {s['address']:<21} {s['pid']:>8} {s['restarts']:>8}  {s['log']}{state}")
    return "\n".join(lines)


def print_status(address: str, workdir: str | None = None) -> int:
    """The fleet of the manager at `address`; with `workdir` (a run of `overworld run`), the manager of
    that run and its services' restarts."""
    services = None
    if workdir:
        try:
            services = read_services(workdir)
        except (OSError, ValueError) as err:
            print(f"error: no services.json of a run in {workdir}: {err}", file=sys.stderr)
            return 1
        address = services["services"]["rollout-manager"]["address"]
        print(format_services(services))
        with contextlib.suppress(OSError, ValueError):  # none before the run's first progress tick
            print(format_run_status(read_run_status(workdir)))
    client = RolloutManagerClient(address)
    try:
        fleet = client.fleet_status()
        videos = client.list_videos() if fleet.videos else []
    except grpc.RpcError as err:
        hint = ""
        if err.code() == grpc.StatusCode.UNAVAILABLE and tls.current_dir() is None:
            hint = " (a run with mutual TLS needs --tls-dir: <workdir>/tls/operator, or the operator's Secret)"
        print(f"error: rollout-manager at {address} unreachable: {err.code().name}{hint}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(format_status(fleet, videos))
    return 0
