"""Recovery time per service: CartPole through `overworld run`, every service killed with SIGKILL in
turn while it trains (the launcher starts it again on its address), on the embedded backends and on
Redis + S3 (its own redis-server and S3-protocol server on loopback). For each kill:

- first call: kill -> the first successful call to the service started in its place (its own RPC:
  GetFleetStatus, GetStats, Estimate, ListVersions, the trainer's and the worker's GetStatus);
- run going on: kill -> the run has a newer model version and more env steps than when the service
  was restarted (a killed trainer's Ray workers, killed then, may publish one last version).

    python -m bench.bench_recovery [--rounds 1]   -> bench/results/recovery.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.runs import write
from rehearsal.chaos_run import KILL_ORDER, ROOT, ChaosRun
from rehearsal.local_stores import RedisServer, S3Server

# Long enough for every round of kills; the run is stopped once they are done.
ARGS = ["--max-env-steps", "10000000", "--set", "train_config.save_interval=5"]


def measure(workdir: Path, args: list[str], env: dict[str, str] | None, rounds: int) -> dict[str, Any]:
    run = ChaosRun(ROOT / "examples/cartpole.yaml", workdir, args, env)
    try:
        run.wait_for(lambda: run.model_version >= 3 and run.env_steps > 0, 300, "training under way")
        for _ in range(rounds):
            for service in KILL_ORDER:
                r = run.kill_and_recover(service)
                print(f"  {service:<18} first call {r.first_call_seconds:6.2f}s   run going on {r.progress_seconds:6.2f}s",
                      flush=True)
    finally:
        run.close()
    out: dict[str, Any] = {}
    for service in KILL_ORDER:
        mine = [r for r in run.recoveries if r.service == service]
        out[service] = {
            "first_call_seconds": round(statistics.median(r.first_call_seconds for r in mine), 2),
            "run_going_on_seconds": round(statistics.median(r.progress_seconds for r in mine), 2),
            "samples": [{"first_call": r.first_call_seconds, "run_going_on": r.progress_seconds} for r in mine]}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_recovery")
    parser.add_argument("--rounds", type=int, default=1, help="times each service is killed per backend")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="recovery-") as tmp:
        print("embedded backends (memory index, local directories):", flush=True)
        results["embedded"] = measure(Path(tmp) / "embedded", ARGS, None, args.rounds)
        redis, s3 = RedisServer(Path(tmp) / "redis"), S3Server()
        redis.start()
        s3.start()
        try:
            bucket = f"recovery-{uuid.uuid4().hex[:8]}"
            stores = ["--set", f"rollout_config.replay_buffer_config.database_config.index={redis.url}",
                      "--set", f"rollout_config.replay_buffer_config.database_config.blobs=s3://{bucket}/rb",
                      "--set", f"train_config.save_path=s3://{bucket}/checkpoints"]
            print("Redis + S3:", flush=True)
            results["redis_s3"] = measure(Path(tmp) / "redis_s3", [*ARGS, *stores], s3.env, args.rounds)
        finally:
            redis.stop()
            s3.stop()
    write("recovery", {"rounds": args.rounds, "kill_order": list(KILL_ORDER), "backends": results,
                       "measured": "kill -> first successful call to the restarted service; kill -> the run "
                                   "has a newer model version and more env steps than when the service was restarted"})


if __name__ == "__main__":
    main()
