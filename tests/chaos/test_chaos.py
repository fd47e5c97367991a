"""Chaos: CartPole through every service, and every service killed with SIGKILL once, in a seeded
random order at seeded random moments inside the windows that matter (chaos_run.wait_for_moment),
while it trains; on the Redis + S3 backends (Redis itself killed too) and on the embedded ones. The
launcher restarts each on its address; the run learns (a return of 450 after the last kill, then it is
stopped as an operator stops it); env steps and model version never go back. Loss is counted exactly:
every worker appends each acknowledgement it receives to a durable log (OVERWORLD_ACK_LOG), and on
Redis every acknowledged (worker, slot, sequence) must be among the index writes Redis made durable
(its append-only file), each written once.

OVERWORLD_CHAOS_SEED=N replays a run's order and moments (each run prints its seed)."""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from redis import Redis

from rehearsal.chaos_run import KILL_ORDER, ROOT, ChaosRun
from tests.e2e.test_cartpole import overworld_processes
from tests.support import RedisServer

SAVE_INTERVAL = 5
# The run cannot end by itself before the last kill (a fast machine reached the target first, and the last
# service was never killed): no target, a cap far away; once every service was killed and the policy is
# back at a return of 450, the test stops the run as an operator would (SIGTERM: graceful).
TARGET = 450.0
ARGS = ["--max-env-steps", "2000000", "--set", f"train_config.save_interval={SAVE_INTERVAL}"]
Ack = tuple[str, int, int]  # worker_id, env_slot, sequence


def non_decreasing(values: list[int]) -> bool:
    return all(a <= b for a, b in zip(values, values[1:], strict=False))


def seed() -> int:
    value = int(os.environ.get("OVERWORLD_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"chaos seed {value} (OVERWORLD_CHAOS_SEED={value} replays it)", flush=True)
    return value


def chaos(workdir: Path, args: list[str], env: dict[str, str] | None = None,
          redis: RedisServer | None = None) -> tuple[ChaosRun, dict, list[Ack]]:
    rng = random.Random(seed())
    plan = [*KILL_ORDER, *(["redis"] if redis else [])]
    rng.shuffle(plan)
    ack_log = workdir.parent / "acks.log"
    run = ChaosRun(ROOT / "examples/cartpole.yaml", workdir, args, {**(env or {}), "OVERWORLD_ACK_LOG": str(ack_log)})
    try:
        run.wait_for(lambda: run.model_version >= 3 and run.env_steps > 0, 300, "training under way")
        for service in plan:
            when = run.wait_for_moment(service, rng, SAVE_INTERVAL)
            if service == "redis":
                assert redis is not None
                run.observe()
                steps, version = run.env_steps, run.model_version
                redis.stop(kill=True)
                time.sleep(rng.uniform(0.5, 2.0))
                redis.start()  # the same port and directory: it reloads what it made durable
                run.wait_progress(steps, version, 240, "progress after killing Redis")
                print(f"redis: killed {when}", flush=True)
                continue
            recovery = run.kill_and_recover(service)
            print(f"{service}: killed {when}; answered {recovery.first_call_seconds:.2f}s after the kill, "
                  f"the run went on after {recovery.progress_seconds:.2f}s", flush=True)
        run.wait_for(lambda: learned(run.progress()), 900, f"a mean return of {TARGET:g} after the last kill")
        run.proc.send_signal(signal.SIGTERM)
        summary = run.finish(300)
    finally:
        run.close()
    assert overworld_processes(workdir) == []
    acks = [(worker, int(slot), int(seq)) for worker, slot, seq, _ in map(str.split, ack_log.read_text().splitlines())]
    return run, summary, acks


def learned(curve: list[dict]) -> bool:
    return bool(curve) and (curve[-1].get("mean_return_last_100") or 0.0) >= TARGET


def check(run: ChaosRun, summary: dict, acks: list[Ack]) -> None:
    assert summary["status"] == "interrupted", (summary, run.tail())
    assert summary["mean_return_last_100"] >= TARGET
    assert summary["restarts"] == {name: 1 for name in KILL_ORDER}
    # never back: as the operator watched it, and as the launcher recorded it
    seen = [o for o in run.observations if o.env_steps is not None]
    assert non_decreasing([o.env_steps for o in seen]) and non_decreasing([o.episodes for o in seen])
    assert non_decreasing([o.model_version for o in run.observations if o.model_version is not None])
    curve = run.progress()
    assert non_decreasing([p["env_steps"] for p in curve]) and non_decreasing([p["model_version"] for p in curve])
    assert non_decreasing([p["episodes"] for p in curve])
    # each fragment acknowledged once (a resend of one whose ack was lost is acknowledged, not twice)
    twice = [a for a, n in Counter(acks).items() if n > 1]
    assert acks and not twice, f"{len(twice)} fragments acknowledged twice, e.g. {twice[:5]}"
    assert summary["fragments_acknowledged"] <= len(acks)  # the manager counts by heartbeat: it can only lag


def indexed(redis: RedisServer) -> list[Ack]:
    """The fragments Redis made durable as indexed: the index's add writes `slots[worker/slot] = sequence`
    once per fragment it takes (services/overworld/replay_buffer/redis_index.py)."""
    out = []
    for command in redis.aof_commands():
        if command[0].upper() == b"HSET" and command[1].endswith(b":slots"):
            for field, value in zip(command[2::2], command[3::2], strict=True):
                worker, slot = field.decode().rsplit("/", 1)
                out.append((worker, int(slot), int(value)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)  # Ray's start dominates on a loaded machine: the trainer starts twice
def test_chaos_on_redis_and_s3(tmp_path: Path, s3_server: dict[str, str]) -> None:
    # A Redis of its own, killed during the run: its append-only file is the buffer's durable record
    redis = RedisServer(tmp_path / "redis", extra_args=("--auto-aof-rewrite-percentage", "0"))
    redis.start()
    try:
        bucket = f"chaos-{uuid.uuid4().hex[:8]}"
        args = [*ARGS, "--set", f"rollout_config.replay_buffer_config.database_config.index={redis.url}",
                "--set", f"rollout_config.replay_buffer_config.database_config.blobs=s3://{bucket}/rb",
                "--set", f"train_config.save_path=s3://{bucket}/checkpoints"]
        run, summary, acks = chaos(tmp_path / "run", args, s3_server, redis)
        writes = indexed(redis)
        client = Redis.from_url(redis.url)
        (meta,) = client.keys("ow:rb:*:meta")
        inserted = int(client.hget(meta, "inserted"))  # at the end (the summary is read before the workers' last flush)
        client.close()
    finally:
        redis.stop()
    check(run, summary, acks)
    # Exactly: every acknowledged fragment was written to the index durably, and written once.
    missing = sorted(set(acks) - set(writes))
    assert not missing, f"{len(missing)} of {len(acks)} acknowledged fragments never reached the index: {missing[:5]}"
    twice = [w for w, n in Counter(writes).items() if n > 1]
    assert not twice, f"{len(twice)} fragments indexed twice: {twice[:5]}"
    # and every indexed fragment is still held or was removed by the buffer's own rules
    # (fragments_per_chunk is 1: a chunk is a fragment)
    assert inserted == len(writes)
    rb = summary["replay_buffer"]
    assert rb["inserted_fragments"] == rb["fragments"] + sum(rb["dropped_chunks"].values())
    assert set(rb["dropped_chunks"]) <= {"stale", "stale_on_arrival", "evicted", "reused"}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_chaos_on_the_embedded_backends(tmp_path: Path) -> None:
    run, summary, acks = chaos(tmp_path / "run", ARGS)
    check(run, summary, acks)
    # The embedded buffer's index lives in its process (docs/architecture.md): what it held when it
    # was killed is gone by design, so its counts start at its restart.
    rb = summary["replay_buffer"]
    assert rb["inserted_fragments"] == rb["fragments"] + sum(rb["dropped_chunks"].values()) > 0
