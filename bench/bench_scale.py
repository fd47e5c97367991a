"""`make scale`: how Overworld behaves as the fleet grows, measured on the scale rehearsal
(rehearsal/scale_rehearsal.py: the chart's services as pods on 200 Mbit/s links, rollout pods running a
Minecraft-paced stand-in with 48 MB of weights).

For each way of pushing weights (relay, the default; star, `OVERWORLD_REGISTRY_RELAY_FANOUT=0`) and
each fleet size N (1, 2, 4, 8, 16, 32), one row:
- the pipeline, trainer running, for `--window` seconds: fleet env steps/s, fragments/s sampled by
  the trainer, the policy lag of what it trained on (median, p95, in versions), each service's CPU
  seconds per second and memory (RSS, PSS), and the push times of the versions it published;
- the push, trainer stopped, once the pods leave the cores at least half idle (a large fleet: once
  the buffer's backpressure holds it; the pods share this machine's two cores, and a fleet stepping
  at full speed would measure them, not the links; the pushes of the pipeline window above are the
  ones under full load): `--pushes` versions published one after the
  other (as the trainer publishes, through a port-forward with its identity), each: publish -> every
  worker swapped it in (last and median), and the registry's egress for it.
Then, relay at the largest N: churn (a quarter of the fleet deleted during a push, the Deployment
replaces them: every survivor and every new pod ends on the version, and, once the fleet is drained,
the buffer holds exactly the fragments the workers had acknowledged), and the soak (`--soak-minutes`
of training: each long-lived service's memory and open files after warm-up, the object store's size
and the Redis key count).

Writes bench/results/scale.json and bench/results/scale.png. Needs root (network namespaces) and,
at N = 32, about 16 GB of memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.runs import RESULTS, RunRecord, ready_to_rehearse, write
from overworld.core.wire import weights
from rehearsal import scale_standin
from rehearsal.netns import wait_until
from rehearsal.oci_images import ImageStore
from rehearsal.scale_rehearsal import (
    BUFFER,
    COMPONENTS,
    REGISTRY,
    TRAINER,
    WORKERS,
    Fleet,
)

LAG_METRIC = "overworld_replay_buffer_sample_policy_lag"


def log(*what: Any) -> None:
    print(time.strftime("%H:%M:%S"), *what, flush=True)


def standin_state(weights_mb: float, seed: int) -> dict[str, torch.Tensor]:
    """Weights of the stand-in policy, as a new version would carry them."""
    env = scale_standin.make_env()
    torch.manual_seed(seed)
    policy = scale_standin.make_policy(env.observation_space, env.action_space, weights_mb=weights_mb)
    return policy.state_dict()


def summed(samples: list[dict[str, float]], name: str) -> dict[str, float]:
    """name{labels} -> value, added over several pods' scrapes."""
    out: dict[str, float] = {}
    for sample in samples:
        for key, value in sample.items():
            if key == name or key.startswith(name + "{"):
                out[key] = out.get(key, 0.0) + value
    return out


def quantiles_from_buckets(before: dict[str, float], after: dict[str, float], name: str) -> dict[str, float | None]:
    """Median and p95 of a Prometheus histogram's increase (upper bucket bounds, as histogram_quantile)."""
    buckets = []
    for key, value in after.items():
        if key.startswith(name + "_bucket{"):
            bound = key.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), value - before.get(key, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    out: dict[str, float | None] = {"count": total}
    for q, label in ((0.5, "median"), (0.95, "p95")):
        out[label] = next((bound for bound, count in buckets if total and count >= q * total), None)
    return out


def usage(fleet: Fleet) -> dict[str, list[dict[str, float]]]:
    return {name: fleet.usage(owner) for name, owner in {**COMPONENTS, "rollout-worker": WORKERS}.items()}


def cost(before: dict[str, list[dict[str, float]]], after: dict[str, list[dict[str, float]]],
         workers: int) -> dict[str, dict[str, float]]:
    """CPU seconds per second and memory of each component (summed over its pods), and per worker pod."""
    out = {}
    for name, pods in after.items():
        earlier = {p["pod"]: p for p in before.get(name, [])}
        cpu = sum((p["cpu_seconds"] - earlier[p["pod"]]["cpu_seconds"]) / (p["t"] - earlier[p["pod"]]["t"])
                  for p in pods if p["pod"] in earlier)
        row = {"pods": len(pods), "cpu_per_second": round(cpu, 4),
               "rss_mb": round(sum(p["rss_bytes"] for p in pods) / 1e6, 1),
               "pss_mb": round(sum(p["pss_bytes"] for p in pods) / 1e6, 1)}
        row["cpu_per_second_per_worker"] = round(cpu / max(workers, 1), 5)
        row["pss_mb_per_worker"] = round(row["pss_mb"] / max(workers, 1), 2)
        out[name] = row
    return out


def window(fleet: Fleet, seconds: float, workers: int) -> dict[str, Any]:
    """The pipeline with the trainer running: throughput, lag, cost, and the pushes of its versions."""
    buffers = fleet.cluster.pods_of(BUFFER)
    start_version = fleet.latest_version()
    lag0 = [fleet.metrics(p) for p in buffers]
    fleet0, use0, t0 = fleet.fleet_status(), usage(fleet), time.monotonic()
    time.sleep(seconds)
    fleet1, use1, t1 = fleet.fleet_status(), usage(fleet), time.monotonic()
    lag1 = [fleet.metrics(p) for p in fleet.cluster.pods_of(BUFFER)]
    end_version = fleet.latest_version()
    sampled = (sum(summed(lag1, "overworld_replay_buffer_samples_total").values())
               - sum(summed(lag0, "overworld_replay_buffer_samples_total").values()))
    pushes = []
    for version in range(start_version + 1, end_version + 1):
        status = fleet.push_status(version)
        if status.complete and status.acked:
            pushes.append(status.push_seconds)
    lag = quantiles_from_buckets(summed(lag0, LAG_METRIC + "_bucket"), summed(lag1, LAG_METRIC + "_bucket"),
                                 LAG_METRIC)
    return {
        "seconds": round(t1 - t0, 1),
        "env_steps_per_second": round((fleet1.env_steps - fleet0.env_steps) / (t1 - t0), 1),
        "env_steps_per_second_per_worker": round((fleet1.env_steps - fleet0.env_steps) / (t1 - t0) / workers, 2),
        "fragments_per_second_to_trainer": round(sampled / (t1 - t0), 2),
        "versions_published": end_version - start_version,
        "push_seconds_median": round(statistics.median(pushes), 2) if pushes else None,
        "push_seconds_max": round(max(pushes), 2) if pushes else None,
        "policy_lag": lag,
        # env-slot seconds waiting for room in the replay buffer over all env-slot seconds, in the window
        "idle_share": (round((fleet1.room_wait_seconds - fleet0.room_wait_seconds)
                             / (fleet1.env_slot_seconds - fleet0.env_slot_seconds), 3)
                       if fleet1.env_slot_seconds > fleet0.env_slot_seconds else None),
        "cost": cost(use0, use1, workers),
    }


def registry_egress(fleet: Fleet) -> float:
    (pod,) = fleet.cluster.pods_of(REGISTRY)
    return fleet.metrics(pod).get("overworld_registry_bytes_pushed_total", 0.0)


def host_idle(seconds: float = 5.0) -> float:
    """The fraction of this machine's CPU time that was idle over the next `seconds`."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all
    idle0, all0 = sample()
    time.sleep(seconds)
    idle1, all1 = sample()
    return (idle1 - idle0) / max(1, all1 - all0)


def wait_quiet(fleet: Fleet, timeout: float = 240.0) -> dict[str, float]:
    """Wait (at most `timeout`) until the pods leave this machine's cores at least half idle: at once
    where the fleet is small, else until it stops stepping (the trainer stopped, the buffer's rate
    limiter holds every worker's fragments). What it was then: host idle fraction, fleet env steps/s."""
    deadline = time.monotonic() + timeout
    while True:
        steps, t0 = fleet.fleet_status().env_steps, time.monotonic()
        idle = host_idle()
        rate = (fleet.fleet_status().env_steps - steps) / (time.monotonic() - t0)
        if idle >= 0.5 or rate < 1.0 or time.monotonic() > deadline:
            return {"host_idle": round(idle, 2), "fleet_env_steps_per_second": round(rate, 1)}


def pushes(fleet: Fleet, count: int, weights_mb: float) -> dict[str, Any]:
    """`count` versions published one after another with nothing else publishing, once the pods leave
    the cores at least half idle (a large fleet: once it is held by backpressure, the trainer having
    stopped sampling): on this machine the pods share two cores, and a fleet stepping at full speed
    would measure the cores, not the links."""
    quiet = wait_quiet(fleet)
    rows = []
    before_use = usage(fleet)
    for _ in range(count):
        version = fleet.latest_version() + 1
        state = standin_state(weights_mb, seed=version)
        before = registry_egress(fleet)
        fleet.publish(version, state)  # (settle_trainer waited for the trainer's last version to be listed)
        status = fleet.push_status(version, wait=600)
        assert status.complete, f"version {version}: push not complete after 600 s ({status})"
        after = registry_egress(fleet)
        acks = sorted(status.ack_seconds)
        rows.append({"version": version, "push_seconds": round(status.push_seconds, 3),
                     "median_worker_seconds": round(statistics.median(acks), 3) if acks else None,
                     "watchers": status.watchers, "acked": status.acked,
                     "registry_egress_mb": round((after - before) / 1e6, 2)})
        log(f"  push of version {version}: {rows[-1]}")
    after_use = usage(fleet)
    size_mb = len(weights.to_bytes(standin_state(weights_mb, 0))) / 1e6

    def cpu(name: str) -> float:
        earlier = {p["pod"]: p["cpu_seconds"] for p in before_use[name]}
        return sum(p["cpu_seconds"] - earlier[p["pod"]] for p in after_use[name] if p["pod"] in earlier)

    workers = max(1, len(after_use["rollout-worker"]))
    gigabytes = count * size_mb / 1e3
    return {"versions": rows, "size_mb": round(size_mb, 2), "before": quiet,
            # what a version costs: each worker's CPU (receive, relay on, check the sha256, swap in; a
            # worker whose sender was held does not step meanwhile) and the registry's, per GB of weights
            "worker_cpu_seconds_per_gb": round(cpu("rollout-worker") / workers / gigabytes, 3),
            "registry_cpu_seconds_per_gb": round(cpu("model-registry") / gigabytes, 3),
            "push_seconds_median": round(statistics.median(r["push_seconds"] for r in rows), 3),
            "median_worker_seconds_median": round(statistics.median(r["median_worker_seconds"] for r in rows), 3),
            "registry_egress_copies": round(statistics.median(r["registry_egress_mb"] for r in rows) / size_mb, 2)}


def settle_trainer(fleet: Fleet, running: bool) -> None:
    if running:
        fleet.start_trainer()
        fleet.wait_ready((TRAINER,), 300)
    else:
        fleet.stop_trainer()
        # its last version is stored and listed (the registry writes it after the trainer's publish
        # stream ends), and its push has ended, before ours begin
        last = fleet.latest_version()
        while True:
            time.sleep(5)
            if fleet.latest_version() == last:
                break
            last = fleet.latest_version()
        fleet.push_status(last, wait=600)


def churn(fleet: Fleet, weights_mb: float) -> dict[str, Any]:
    """A quarter of the fleet deleted during a push; the Deployment replaces them."""
    pods = fleet.worker_pods()
    n = len(pods)
    version = fleet.latest_version() + 1
    state = standin_state(weights_mb, seed=version)
    publishing = time.monotonic()
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(fleet.publish(version, state)), daemon=True)
    thread.start()
    egress = registry_egress(fleet)
    # the registry has begun to send the version's stripes: the relays are passing it on
    wait_until(lambda: registry_egress(fleet) > egress, 120, "the churn version's push under way", interval=0.05)
    deleted = pods[: n // 4]
    for pod in deleted:
        fleet.cluster.delete_pod(pod, graceful=True, wait=False)
    thread.join(300)
    status = fleet.push_status(version, wait=600)
    fleet.wait_fleet(n)

    def all_on_version() -> bool:
        return all(w.model_version == version for w in fleet.fleet_status().workers)

    wait_until(all_on_version, 300, f"every worker (survivors and new pods) on version {version}", interval=2)
    survivors = [p.name for p in pods[n // 4:]]
    return {"workers": n, "deleted": len(deleted), "version": version,
            "push": {"watchers": status.watchers, "acked": status.acked, "complete": status.complete,
                     "push_seconds": round(status.push_seconds, 2)},
            "survivors_acked": status.acked >= len(survivors),
            "every_worker_on_version_after_seconds": round(time.monotonic() - publishing, 1)}


def drained_accounting(fleet: Fleet) -> dict[str, Any]:
    """Scale the fleet to 0 (each worker flushes what it holds and deregisters), then compare what the
    workers had acknowledged with what the buffer took in."""
    fleet.scale(0)
    wait_until(lambda: not fleet.worker_pods(), 300, "the fleet drained")
    time.sleep(3)
    fleet_status = fleet.fleet_status()
    stats = [fleet.buffer_stats(p) for p in fleet.cluster.pods_of(BUFFER)]
    inserted = max(s.inserted_fragments for s in stats)  # one Redis index behind both fronts
    acknowledged = fleet_status.fragments_sent
    duplicates = sum(summed([fleet.metrics(p) for p in fleet.cluster.pods_of(BUFFER)],
                            "overworld_replay_buffer_duplicates_total").values())
    return {"fragments_acknowledged_to_workers": acknowledged, "fragments_inserted": inserted,
            "resent_duplicates_not_stored": duplicates, "exact": acknowledged == inserted}


def store_footprint(fleet: Fleet) -> dict[str, float]:
    """The object store's keys (listed from a replay-buffer pod, which holds the store's address and
    keys) by what they are, and Redis' key count."""
    buffer = fleet.cluster.pod(BUFFER)
    bucket = buffer.env["OVERWORLD_BLOBS"].removeprefix("s3://").split("/", 1)[0]
    script = ("import sys; from overworld.core.blobs.urls import open_blob_store; "
              "print('\\n'.join(open_blob_store(sys.argv[1]).keys()))")
    keys = fleet.cluster.exec(buffer, "python", "-c", script, f"s3://{bucket}/").split()
    counts = {"object_store_keys": len(keys),
              "model_versions": sum(k.endswith("/manifest.json") and "/models/" in f"/{k}" for k in keys),
              "checkpoints": len({k.split("/checkpoints/", 1)[1].split("/", 1)[0] for k in keys if "/checkpoints/" in k})}
    redis = fleet.cluster.pod(COMPONENTS["redis"])
    dbsize = fleet.cluster.exec(redis, "sh", "-c", 'redis-cli -a "$REDIS_PASSWORD" --no-auth-warning dbsize')
    return {**counts, "redis_keys": int(dbsize.strip() or 0)}


def soak(fleet: Fleet, minutes: float, warmup_minutes: float | None = None) -> dict[str, Any]:
    """Memory and open files of every pod, and the stores' sizes, once a minute for `minutes` (four times
    in a soak shorter than four minutes); the drift is measured after `warmup_minutes` (5, or half of a
    shorter soak)."""
    warmup_minutes = min(5.0, minutes / 2) if warmup_minutes is None else warmup_minutes
    interval = min(60.0, minutes * 60 / 4)
    samples = []
    end = time.monotonic() + minutes * 60
    started = time.monotonic()
    while time.monotonic() < end:
        use = usage(fleet)
        row = {"minute": round((time.monotonic() - started) / 60, 2), **store_footprint(fleet),
               "version": fleet.latest_version(), "env_steps": fleet.fleet_status().env_steps}
        for name in ("model-registry", "rollout-manager", "replay-buffer", "gae", "trainer", "redis", "object-store",
                     "rollout-worker"):
            for pod in use[name]:
                row[f"{pod['pod']}.rss_mb"] = round(pod["rss_bytes"] / 1e6, 1)
                row[f"{pod['pod']}.fds"] = pod["fds"]
        samples.append(row)
        log(f"  soak minute {row['minute']}: version {row['version']}, {row['object_store_keys']} objects, "
            f"{row['redis_keys']} Redis keys")
        time.sleep(interval)
    settled = [s for s in samples if s["minute"] >= warmup_minutes]
    drift = {}
    # every pod seen after the warm-up, pods that replaced others during the soak included
    for key in sorted({k for s in settled for k in s}):
        if key.endswith((".rss_mb", ".fds")):
            values = [s[key] for s in settled if key in s]
            # a leak is a trend: the mean of the last third against the first third (a point sample
            # catches a version in flight, or connections open at that instant)
            third = max(1, len(values) // 3)
            first, last = sum(values[:third]) / third, sum(values[-third:]) / third
            drift[key] = {"min": min(values), "max": max(values), "first_third_mean": round(first, 1),
                          "last_third_mean": round(last, 1), "spread": round(last / max(first, 1e-9) - 1, 3)}
    bounded = {k: {"min": min(s[k] for s in settled), "max": max(s[k] for s in settled)}
               for k in ("object_store_keys", "model_versions", "checkpoints", "redis_keys")} if settled else {}
    return {"minutes": minutes, "warmup_minutes": warmup_minutes, "samples": samples, "after_warmup": drift,
            "stores": bounded,
            "largest_drift": max((v["spread"] for v in drift.values()), key=abs, default=None),
            "within_10_percent": all(abs(v["spread"]) <= 0.10 for v in drift.values()) if drift else None}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (push_ax, rate_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, rows in result["curve"].items():
        ns = [r["workers"] for r in rows]
        push_ax.plot(ns, [r["push"]["push_seconds_median"] for r in rows], "o-", label=mode)
        rate_ax.plot(ns, [r["pipeline"]["env_steps_per_second"] for r in rows], "o-", label=f"{mode}: env steps/s")
    if result["curve"]:
        ns = [r["workers"] for r in next(iter(result["curve"].values()))]
        rate_ax.plot(ns, [20 * n for n in ns], ":", color="grey", label="20 steps/s per pod")
    push_ax.set(xscale="log", yscale="log", xlabel="rollout pods", ylabel="publish → last worker swapped in (s)",
                title=f"weights push, {result['weights_mb']:.0f} MB at {result['link_mbit']:.0f} Mbit/s")
    rate_ax.set(xscale="log", yscale="log", xlabel="rollout pods", ylabel="fleet env steps/s",
                title="fleet throughput (trainer running)")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax in (push_ax, rate_ax):
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        if result["curve"]:
            ax.set_xticks(ns, [str(n) for n in ns])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2,4,8,16,32")
    p.add_argument("--modes", default="relay,star")
    p.add_argument("--window", type=float, default=120.0, help="seconds of training measured at each size")
    p.add_argument("--pushes", type=int, default=3, help="versions pushed with the trainer stopped, at each size")
    p.add_argument("--weights-mb", type=float, default=48.0)
    p.add_argument("--soak-minutes", type=float, default=30.0, help="0: no soak")
    p.add_argument("--workdir", default="/var/tmp/overworld-scale")
    p.add_argument("--results", type=Path, default=RESULTS, help="where scale.json and scale.png go")
    p.add_argument("--name", default="scale", help="the result's name: NAME.json (and NAME.png)")
    p.add_argument("--training-only", action="store_true",
                   help="only the pipeline while training at each size: no pushes with the trainer stopped, no churn")
    args = p.parse_args(argv)
    store = ready_to_rehearse("bench_scale", Path(args.workdir) / "image-build.log", target="scale-images")
    if store is None:
        return 1
    try:
        return measure(args, store, argv)
    finally:
        store.close()


def measure(args: argparse.Namespace, store: ImageStore, argv: list[str] | None) -> int:
    sizes = [int(n) for n in args.sizes.split(",")]
    result: dict[str, Any] = {"command": " ".join(["python -m bench.bench_scale", *(argv or sys.argv[1:])]),
                              "weights_mb": args.weights_mb, "sizes": sizes, "curve": {}}
    for mode in args.modes.split(","):
        fanout = {"relay": 2, "star": 0}[mode]
        rows: list[dict[str, Any]] = []
        result["curve"][mode] = rows
        with Fleet.up(Path(args.workdir) / mode, store, workers=sizes[0], relay_fanout=fanout,
                      weights_mb=args.weights_mb) as fleet:
            result["link_mbit"], result["link_delay_ms"] = fleet.link
            for n in sizes:
                log(f"{mode}: {n} rollout pods")
                fleet.scale(n)
                fleet.wait_fleet(n)
                settle_trainer(fleet, running=True)
                fleet.wait_fleet(n)
                time.sleep(15)  # new pods past their first version and their imports
                with RunRecord() as record:
                    pipeline = window(fleet, args.window, n)
                pipeline["measured"] = record.fields  # its commit, start and the load at start and end
                log(f"  pipeline: {json.dumps({k: v for k, v in pipeline.items() if k != 'cost'})}")
                if args.training_only:
                    rows.append({"workers": n, "relay_fanout": fanout, "pipeline": pipeline})
                    write(args.name, result, args.results)
                    continue
                settle_trainer(fleet, running=False)
                push = pushes(fleet, args.pushes, args.weights_mb)
                rows.append({"workers": n, "relay_fanout": fanout, "pipeline": pipeline, "push": push})
                write(args.name, result, args.results)
            if mode == "relay" and not args.training_only:
                log("relay: churn")
                result["churn"] = churn(fleet, args.weights_mb)
                log(f"  {result['churn']}")
                if args.soak_minutes:
                    settle_trainer(fleet, running=True)
                    log(f"relay: soak, {args.soak_minutes:g} minutes")
                    result["soak"] = soak(fleet, args.soak_minutes)
                    settle_trainer(fleet, running=False)
                result["churn"]["accounting"] = drained_accounting(fleet)
                log(f"  {result['churn']['accounting']}")
            write(args.name, result, args.results)
    if not args.training_only:
        plot(result, args.results / f"{args.name}.png")
    write(args.name, result, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
