"""What a preemption costs, in the cluster rehearsal (issue 40): pods deleted as a spot node's reclaim
deletes them (preStop, SIGTERM, SIGKILL once the grace period is over), repeatedly, while a CartPole run
whose envs step at a slower game's pace trains.

For each grace period (30 s: GKE's and Azure's spot VMs; 120 s: AWS' spot instances), a rehearsal whose
chart has `rolloutWorker.terminationGracePeriodSeconds` at that value, and in it:
- rollout worker preemptions, one pod at a time: the env steps it threw away (the fleet's
  `preempted_env_steps`, from its last heartbeat), its own ledger (complete fragments against those the
  replay buffer acknowledged, from its log), the seconds it took to go, and from the deletion the seconds
  until the Deployment's replacement holds a lease and until the learner published a newer version;
- front preemptions: one pod of the rollout-manager, the model-registry, the replay buffer and gae
  deleted in turn: the calls the fleet saw fail (`overworld_client_calls_failed_total` of every live
  worker, by call) and the attempts it made again (`overworld_client_call_retries_total`), the seconds until the front is ready again and until a newer version;
- a trainer preemption: the Ray head pod deleted with that grace period: the iteration it had reached,
  the checkpoint the next attempt resumed from (iterations lost), the seconds until a newer version.
At the end the workers are scaled to 0 and the replay index's inserted fragments are compared with what
every worker pod of the run counted as acknowledged: nothing acknowledged may be missing.

    sudo python -m bench.bench_preemption [--graces 30,120] [--worker-preemptions 3] [--workers 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.runs import RESULTS, RunRecord, ready_to_rehearse, write
from overworld.trainer.checkpoint import iteration_of
from rehearsal.netns import wait_until
from rehearsal.oci_images import ImageStore
from rehearsal.pods import RELEASE
from rehearsal.training_rehearsal import Rehearsal, rehearsal_values, worker_stops

WORKERS = f"{RELEASE}-rollout-worker"
FRONTS = ("rollout-manager", "model-registry", "replay-buffer", "gae")
FAILED_CALLS, CALL_RETRIES = "overworld_client_calls_failed_total", "overworld_client_call_retries_total"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def values(grace: int, workers: int, step_ms: float) -> dict[str, Any]:
    out = rehearsal_values()
    out["rolloutWorker"]["replicaCount"] = workers
    out["rolloutWorker"]["terminationGracePeriodSeconds"] = grace
    out["trainer"]["terminationGracePeriodSeconds"] = grace  # the trainer reads it as its deadline
    out["run"]["config"]["env_kwargs"] = {"id": "CartPole-v1", "step_seconds": step_ms / 1000}
    out["run"]["config"]["rollout_config"]["worker_config"]["num_envs"] = 1
    return out


def live_workers(rehearsal: Rehearsal) -> set[str]:
    return {w.worker_id for w in rehearsal.fleet().workers if w.seconds_since_heartbeat < 10}


def preempt_worker(rehearsal: Rehearsal, grace: int, workers: int) -> dict[str, Any]:
    cluster = rehearsal.cluster
    victim = min(cluster.pods_of(WORKERS), key=lambda p: p.started)
    before = live_workers(rehearsal)
    lost_before = int(rehearsal.fleet().preempted_env_steps)
    version = rehearsal.registry_version()
    deleted = time.monotonic()
    cluster.delete_pod(victim, graceful=True, grace=grace)
    gone = time.monotonic() - deleted
    # its last heartbeat (the manager counts what it threw away) came before it exited
    lost = int(rehearsal.fleet().preempted_env_steps) - lost_before
    # back: as many live workers as before, one of them the replacement (a new worker id)
    wait_until(lambda: len(now := live_workers(rehearsal)) >= workers and now - before, 300,
               f"{workers} live workers again, the replacement among them")
    fleet_back = time.monotonic() - deleted
    rehearsal.wait_training(beyond=version, timeout=300)
    learner_back = time.monotonic() - deleted
    stops = worker_stops(victim)
    return {"pod": victim.name, "seconds_to_go": round(gone, 1), "env_steps_thrown_away": lost,
            "stop": stops[-1] if stops else None, "seconds_until_fleet_back": round(fleet_back, 1),
            "seconds_until_a_newer_version": round(learner_back, 1)}


def preempt_trainer(rehearsal: Rehearsal, grace: int) -> dict[str, Any]:
    cluster = rehearsal.cluster
    ray_cluster = rehearsal.rayjob()["status"]["rayClusterName"]
    head = cluster.pod(f"{ray_cluster}-head")
    status = rehearsal.trainer_status()
    version = rehearsal.registry_version()
    deleted = time.monotonic()
    cluster.delete_pod(head, graceful=True, grace=grace)
    gone = time.monotonic() - deleted
    # wait_until's probe may raise while the new head starts (no RayCluster named, nothing answering)
    resumed = wait_until(lambda: (s := rehearsal.trainer_status()).state == "running" and s.resumed_from and s,
                         900, "the next trainer resumed", interval=2.0)
    rehearsal.wait_training(beyond=max(version, int(resumed.start_model_version)), timeout=600)
    back = time.monotonic() - deleted
    resumed_iteration = iteration_of(resumed.resumed_from)
    return {"pod": head.name, "iteration_at_deletion": int(status.iteration), "seconds_to_go": round(gone, 1),
            "resumed_from": resumed.resumed_from,
            "iterations_lost": max(0, int(status.iteration) - resumed_iteration),
            "seconds_until_a_newer_version": round(back, 1)}


def fleet_calls(rehearsal: Rehearsal, metric: str) -> Counter[str]:
    """A client-call counter summed over the live workers, by call."""
    seen: Counter[str] = Counter()
    for pod in rehearsal.cluster.pods_of(WORKERS):
        for sample, value in rehearsal.metrics(pod).items():
            if sample.startswith(metric + "{"):
                seen[sample.split('"')[1]] += int(value)
    return seen


def preempt_front(rehearsal: Rehearsal, front: str, grace: int) -> dict[str, Any]:
    """One pod of a front deleted as a preemption deletes it; what the fleet saw of the hand-over."""
    cluster = rehearsal.cluster
    owner = f"{RELEASE}-{front}"
    replicas = len(cluster.pods_of(owner))
    victim = cluster.pods_of(owner)[0]
    before = {metric: fleet_calls(rehearsal, metric) for metric in (FAILED_CALLS, CALL_RETRIES)}
    version = rehearsal.registry_version()
    deleted = time.monotonic()
    leaving = cluster.delete_pod(victim, graceful=True, grace=grace, wait=False)
    wait_until(lambda: sum(p.ready for p in cluster.pods_of(owner)) >= replicas, 300, f"{front} ready again")
    ready = time.monotonic() - deleted
    leaving.join()
    gone = time.monotonic() - deleted
    rehearsal.wait_training(beyond=version, timeout=300)
    learner_back = time.monotonic() - deleted
    failed, retried = (fleet_calls(rehearsal, metric) - before[metric] for metric in (FAILED_CALLS, CALL_RETRIES))
    return {"front": front, "pod": victim.name, "replicas": replicas, "seconds_to_go": round(gone, 1),
            "seconds_until_ready_again": round(ready, 1), "seconds_until_a_newer_version": round(learner_back, 1),
            "failed_calls_seen_by_the_fleet": dict(failed), "attempts_the_fleet_made_again": dict(retried)}


def fleet_ledger(rehearsal: Rehearsal) -> dict[str, Any]:
    """Every worker pod stopped; the index's inserted fragments against what every pod acknowledged."""
    cluster = rehearsal.cluster
    cluster.scale(WORKERS, 0)
    wait_until(lambda: all(p.ended for p in cluster.pods_of(WORKERS, include_ended=True)), 300, "no worker running")
    seen: list[int] = []

    def settled() -> int:
        seen.append(int(rehearsal.redis_meta().get("inserted", 0)))
        return seen[-1] if len(seen) > 2 and seen[-1] == seen[-2] == seen[-3] else 0

    inserted = wait_until(settled, 60, "the index settled", interval=1.0)
    stops = [s for p in cluster.pods_of(WORKERS, include_ended=True) for s in worker_stops(p)]
    acknowledged = sum(s["acknowledged"] for s in stops)
    return {"worker_stops": len(stops), "acknowledged": acknowledged, "inserted_in_the_index": inserted,
            "complete_not_acknowledged": sum(s["complete"] - s["acknowledged"] for s in stops),
            "nothing_acknowledged_lost": inserted >= acknowledged and all(s["flushed"] for s in stops)}


def one_grace(args: argparse.Namespace, store: ImageStore, grace: int) -> dict[str, Any]:
    workdir = Path(args.workdir) / f"grace-{grace}"
    with RunRecord() as record, Rehearsal.up(workdir, store, values(grace, args.workers, args.step_ms)) as rehearsal:
        log(f"grace {grace} s: cluster up; waiting for training")
        version = rehearsal.wait_training(timeout=600)
        wait_until(lambda: len(live_workers(rehearsal)) >= args.workers, 300, f"{args.workers} live workers")
        rehearsal.wait_training(beyond=version + 10, timeout=600)  # past the start: every worker stepping
        workers = []
        for i in range(args.worker_preemptions):
            workers.append(preempt_worker(rehearsal, grace, args.workers))
            log(f"worker preemption {i + 1}: {workers[-1]}")
        fronts = []
        for front in FRONTS:
            fronts.append(preempt_front(rehearsal, front, grace))
            log(f"front preemption: {fronts[-1]}")
        trainer = preempt_trainer(rehearsal, grace)
        log(f"trainer preemption: {trainer}")
        books = fleet_ledger(rehearsal)
        log(f"ledger: {books}")
    return {"grace_seconds": grace, **record.fields, "worker_preemptions": workers, "front_preemptions": fronts,
            "trainer_preemption": trainer,
            "ledger": books}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graces", default="30,120", help="grace periods, s")
    p.add_argument("--worker-preemptions", type=int, default=3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=20.0, help="each env step takes at least this long")
    p.add_argument("--workdir", default="/var/tmp/overworld-preemption")
    args = p.parse_args(argv)
    store = ready_to_rehearse("bench_preemption", Path(args.workdir).with_name("preemption-image-build.log"))
    if store is None:
        return 1
    try:
        runs = [one_grace(args, store, int(g)) for g in args.graces.split(",")]
    finally:
        store.close()
    write("preemption", {"command": " ".join(["python -m bench.bench_preemption", *(argv or sys.argv[1:])]),
                         "workers": args.workers, "step_ms": args.step_ms, "runs": runs,
                         "nothing_acknowledged_lost": all(r["ledger"]["nothing_acknowledged_lost"] for r in runs)},
          RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
