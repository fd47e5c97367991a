"""The rollout fleet sized by Kubernetes' own autoscaling, in the cluster rehearsal (issue 40).

The chart with `rolloutWorker.autoscaling` on (its KEDA ScaledObject), a CartPole run whose envs step
at a slower game's pace (`env_kwargs.step_seconds`, so that one worker cannot feed the learner), and
the rehearsal's stand-in for KEDA and the HPA controller (rehearsal/autoscaler.py): every `--sync`
seconds it asks the real Prometheus the ScaledObject's query and scales the worker Deployment by the
HPA's algorithm. Shortened for the rehearsal, and recorded in the results: the sync period (the HPA's
15 s), the stabilization windows (the chart's 60 s up, 300 s down), the rate() window (the chart's 2m).

From one worker, every 10 s: the replicas, the metric, the learner's wait share, the fleet's idle
share, its env steps/s and the return of the last 100 episodes. Results: bench/results/NAME.json and a
plot, docs/images/NAME.png.

    sudo python -m bench.bench_autoscaling [--minutes 15] [--step-ms 20] [--envs-per-worker 1] [--max-workers 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.runs import RESULTS, RunRecord, ready_to_rehearse, write
from rehearsal.autoscaler import Autoscaler, Behavior
from rehearsal.chart import by_kind
from rehearsal.pods import RELEASE, REPO
from rehearsal.training_rehearsal import Rehearsal, rehearsal_values

WORKERS = f"{RELEASE}-rollout-worker"
SELECT = f'overworld_release="{RELEASE}"'
IMAGES = REPO / "docs" / "images"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def autoscaling_values(args: argparse.Namespace) -> dict[str, Any]:
    values = rehearsal_values()
    worker = values["rolloutWorker"]
    worker["replicaCount"] = None
    worker["autoscaling"] = {"enabled": True, "prometheusAddress": "http://prometheus.monitoring:9090",
                             "minReplicas": 1, "maxReplicas": args.max_workers, "targetBusyShare": args.target,
                             "window": args.window, "scaleUpStabilizationSeconds": args.up_window,
                             "scaleDownStabilizationSeconds": args.down_window}
    config = values["run"]["config"]
    config["env_kwargs"] = {"step_seconds": args.step_ms / 1000}
    config["rollout_config"]["worker_config"]["num_envs"] = args.envs_per_worker
    return values


def sample(rehearsal: Rehearsal, started: float, window: str) -> dict[str, Any]:
    fleet = rehearsal.fleet()
    value = rehearsal.prometheus.value
    wait = value(f"sum(rate(overworld_trainer_sample_wait_seconds_total{{{SELECT}}}[{window}]))")
    idle = value(f"sum(rate(overworld_env_room_wait_seconds_total{{{SELECT}}}[{window}])) / "
                 f"sum(overworld_env_slots{{{SELECT}}})")
    steps = value(f"sum(rate(overworld_env_steps_total{{{SELECT}}}[{window}]))")
    return {"seconds": round(time.monotonic() - started, 1), "replicas": rehearsal.workload(WORKERS).replicas,
            "workers_registered": len(fleet.workers), "env_steps": int(fleet.env_steps),
            "env_steps_per_second": None if steps is None else round(steps, 1),
            "learner_wait_share": None if wait is None else round(wait, 3),
            "fleet_idle_share": None if idle is None else round(idle, 3),
            "return_last_100": round(fleet.mean_return_last_100, 1) if fleet.episodes else None,
            "preempted_env_steps": int(fleet.preempted_env_steps)}


def outcome(samples: list[dict[str, Any]], trajectory: list[dict[str, Any]]) -> dict[str, Any]:
    """How it went: the size it settled at, the changes in the last third (flapping), the learner's
    wait and the fleet's idle share there, and the return from the start to the end."""
    last = samples[len(samples) * 2 // 3:]
    changes = [t for t in trajectory if "desired" in t and t["desired"] != t["replicas"]]
    late = [t for t in changes if t["seconds"] >= last[0]["seconds"]] if last else []

    def mean(key: str) -> float | None:
        got = [s[key] for s in last if s[key] is not None]
        return round(sum(got) / len(got), 3) if got else None

    returns = [s["return_last_100"] for s in samples if s["return_last_100"] is not None]
    return {"replicas_at_end": samples[-1]["replicas"], "largest": max(s["replicas"] for s in samples),
            "scalings": len(changes), "scalings_in_the_last_third": len(late),
            "learner_wait_share_last_third": mean("learner_wait_share"),
            "fleet_idle_share_last_third": mean("fleet_idle_share"),
            "env_steps_per_second_last_third": mean("env_steps_per_second"),
            "return_first": returns[0] if returns else None, "return_last": returns[-1] if returns else None}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["seconds"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].step(minutes, [s["replicas"] for s in samples], where="post", label="replicas")
    axes[0].plot(minutes, [s["workers_registered"] for s in samples], ".", label="workers registered")
    axes[0].set_ylabel("rollout pods")
    axes[0].legend(loc="lower right")
    metric = [(t["seconds"] / 60, t["metric"]) for t in result["trajectory"] if t.get("metric") is not None]
    axes[1].plot([m for m, _ in metric], [v for _, v in metric], label="metric (target dashed)")
    axes[1].axhline(result["settings"]["target_busy_share"], linestyle="--", color="grey")
    axes[1].plot(minutes, [s["learner_wait_share"] for s in samples], label="learner wait share")
    axes[1].plot(minutes, [s["fleet_idle_share"] for s in samples], label="fleet idle share")
    axes[1].legend(loc="upper right")
    axes[2].plot(minutes, [s["env_steps_per_second"] for s in samples], label="env steps/s")
    axes[2].set_ylabel("env steps/s")
    twin = axes[2].twinx()
    twin.plot(minutes, [s["return_last_100"] for s in samples], color="tab:green", label="return (100)")
    twin.set_ylabel("return")
    axes[2].set_xlabel("minutes")
    fig.suptitle(f"Autoscaling in the rehearsal: CartPole at {result['settings']['step_ms']} ms per step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=15.0, help="how long the autoscaler runs")
    p.add_argument("--step-ms", type=float, default=20.0, help="each env step takes at least this long")
    p.add_argument("--envs-per-worker", type=int, default=1,
                   help="few, so that the fleet, not the replay buffer's room, is what the learner waits for")
    p.add_argument("--max-workers", type=int, default=10)
    p.add_argument("--target", type=float, default=0.75, help="targetBusyShare (the chart's default)")
    p.add_argument("--sync", type=float, default=5.0, help="seconds between the autoscaler's looks (the HPA's 15)")
    p.add_argument("--up-window", type=int, default=10, help="scale-up stabilization, s (the chart's 60)")
    p.add_argument("--down-window", type=int, default=60, help="scale-down stabilization, s (the chart's 300)")
    p.add_argument("--window", default="30s", help="the metric's rate() window (the chart's 2m)")
    p.add_argument("--workdir", default="/var/tmp/overworld-autoscaling")
    p.add_argument("--name", default="autoscaling")
    args = p.parse_args(argv)
    store = ready_to_rehearse("bench_autoscaling", Path(args.workdir).with_name("autoscaling-image-build.log"))
    if store is None:
        return 1
    settings = {"step_ms": args.step_ms, "envs_per_worker": args.envs_per_worker, "max_workers": args.max_workers, "target_busy_share": args.target,
                "sync_seconds": args.sync, "scale_up_window_seconds": args.up_window,
                "scale_down_window_seconds": args.down_window, "rate_window": args.window,
                "shortened": "sync 15 s, windows 60/300 s and rate window 2m in the chart and the HPA; shorter "
                             "here so that a run of minutes shows the fleet settle"}
    try:
        with RunRecord() as record, Rehearsal.up(Path(args.workdir), store, autoscaling_values(args)) as rehearsal:
            log("cluster up; waiting for the first trained version")
            rehearsal.wait_training(timeout=600)
            (scaled_object,) = by_kind(rehearsal.objects, "ScaledObject").values()
            behavior = Behavior.of(scaled_object)
            scaler = Autoscaler(scaled_object, rehearsal.prometheus.value, lambda: rehearsal.workload(WORKERS).replicas,
                                lambda n: rehearsal.cluster.scale(WORKERS, n), sync=args.sync, behavior=behavior)
            scaler.start()
            started, samples = scaler.started, []
            try:
                while time.monotonic() - started < args.minutes * 60:
                    time.sleep(10)
                    samples.append(sample(rehearsal, started, args.window))
                    log(f"{samples[-1]}")
            finally:
                scaler.stop()
        result = {**record.fields, "command": " ".join(["python -m bench.bench_autoscaling", *(argv or sys.argv[1:])]),
                  "settings": settings, "behavior": vars(behavior), "samples": samples,
                  "trajectory": scaler.trajectory, "outcome": outcome(samples, scaler.trajectory)}
    finally:
        store.close()
    write(args.name, result, RESULTS)
    plot(result, IMAGES / f"{args.name}.png")
    log(f"outcome: {result['outcome']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
