"""`overworld status`: the fleet as the rollout-manager sees it."""

from __future__ import annotations

import sys

import grpc

from overworld.rollout_manager.client import RolloutManagerClient


def print_status(address: str) -> int:
    try:
        fleet = RolloutManagerClient(address).fleet_status()
    except grpc.RpcError as err:
        print(f"error: rollout-manager at {address} unreachable: {err.code().name}", file=sys.stderr)
        return 1
    print(f"run {fleet.run_id}: {len(fleet.workers)} workers, {fleet.env_steps:,} env steps, "
          f"{fleet.episodes} episodes, mean return (last 100) {fleet.mean_return_last_100:.2f}")
    print(f"{'worker':<12} {'host':<20} {'envs':>5} {'env steps':>12} {'fragments':>10} {'model':>6} {'heartbeat':>10}")
    for w in fleet.workers:
        print(f"{w.worker_id:<12} {w.hostname[:20]:<20} {w.num_envs:>5} {w.env_steps:>12,} {w.fragments_sent:>10} "
              f"{w.model_version:>6} {w.seconds_since_heartbeat:>9.1f}s")
    for t in fleet.tasks:
        extras = "  ".join(f"{k}={v:.2f}" for k, v in sorted(t.mean_extras_last_100.items())[:6])
        print(f"task {t.task}: {t.episodes} episodes, return {t.mean_return_last_100:.2f}, "
              f"length {t.mean_length_last_100:.0f} {extras}")
    return 0
