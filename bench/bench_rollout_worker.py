"""A rollout worker's env steps/s on Crafter (examples/crafter_cow.yaml's env) with 2 env processes,
next to the same 2 Crafter envs stepped by bare processes with random actions (resets inline, as a
plain loop does them) and by gymnasium's AsyncVectorEnv, on the same cores in the same run.

The worker runs against an in-process rollout-manager, replay buffer (no rate limiter, large
max_chunks) and model registry holding a published random policy; nothing trains. Worker rows,
with a tiny CNN policy (the worker's own overhead: what a GPU worker's CPU side costs): 2 envs (one
per process, inference batch 1), 16 envs in batches of 4 (crafter_cow.yaml's worker: two groups
per process, each whole in its process) and 32 envs in batches of 8; and 16 envs with
crafter_cow.yaml's CNN (on CPU its inference competes with the envs for the same two cores).
The two bare phases bracket the others, so that a change of load from other processes shows.

    python bench/bench_rollout_worker.py [--seconds 10]     # writes bench/results/rollout_worker.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.runs, when run as a script
from bench.runs import provenance  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "rollout_worker.json"
ENV_REF = "overworld.envs.crafter_cow:make_env"
TARGET = 0.85


def crafter_kwargs() -> dict[str, Any]:
    from overworld.core.config import load_config

    return dict(load_config(ROOT / "examples/crafter_cow.yaml").env_kwargs)


# -- bare processes ---------------------------------------------------------------------------------
def _bare(seed: int, kwargs: dict[str, Any], start: Any, seconds: float, out: Any) -> None:
    from overworld.envs.crafter_cow import make_env

    env = make_env(**kwargs)
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    start.wait()
    steps, resets = 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        steps += 1
        if terminated or truncated:
            env.reset()
            resets += 1
    out.put((steps, resets))


def bare_processes(n: int, seconds: float, kwargs: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_bare, args=(i, kwargs, start, seconds, out)) for i in range(n)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # imports and the first reset, outside the measurement
    start.set()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    steps = sum(r[0] for r in results)
    return {"env_steps_per_second": steps / seconds, "env_steps": steps, "episodes": sum(r[1] for r in results),
            "seconds": seconds, "processes": n}


# -- gymnasium AsyncVectorEnv -----------------------------------------------------------------------
def _make(kwargs: dict[str, Any]) -> Any:
    from overworld.envs.crafter_cow import make_env

    return make_env(**kwargs)


def async_vector_env(n: int, seconds: float, kwargs: dict[str, Any]) -> dict[str, Any]:
    import functools

    import gymnasium as gym

    envs = gym.vector.AsyncVectorEnv([functools.partial(_make, kwargs)] * n, context="spawn")
    try:
        envs.reset(seed=0)
        rng = np.random.default_rng(0)
        steps, episodes = 0, 0
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            _, _, terminated, truncated, _ = envs.step(rng.integers(17, size=n))
            steps += n
            episodes += int((terminated | truncated).sum())
        elapsed = time.monotonic() - started
    finally:
        envs.close()
    return {"env_steps_per_second": steps / elapsed, "env_steps": steps, "episodes": episodes, "seconds": elapsed,
            "num_envs": n, "note": "autoreset inside step (gymnasium's NextStep mode counts the reset step)"}


# -- the rollout worker -------------------------------------------------------------------------------
class WorkerBench:
    def __init__(self, policy_kwargs: dict[str, Any] | None, num_envs: int, workdir: Path, start: bool = True,
                 batch_size: int | None = None, config_path: str = "examples/crafter_cow.yaml",
                 overrides: tuple[str, ...] = ()) -> None:
        """`policy_kwargs` None: the config's policy; `overrides` (dotted.key=value) come last
        (bench/gpu/check.py: crafter_resnet.yaml's ResNet on CUDA and on the CPU)."""
        from overworld.core.blobs.store import LocalBlobStore
        from overworld.core.config import load_config
        from overworld.core.grpc_util import serve
        from overworld.core.wire.weights import to_bytes
        from overworld.model_registry.client import ModelRegistryClient
        from overworld.model_registry.server import ModelRegistryService
        from overworld.replay_buffer.client import ReplayBufferClient
        from overworld.replay_buffer.index import MemoryIndex
        from overworld.replay_buffer.server import ReplayBufferService
        from overworld.rollout_manager.server import RolloutManagerService
        from overworld.rollout_worker.worker import RolloutWorker, run_spaces
        from overworld.v1 import model_registry_pb2_grpc, replay_buffer_pb2_grpc, rollout_manager_pb2_grpc

        config = load_config(ROOT / config_path, [
            "run_id=bench", f"rollout_config.worker_config.num_envs={num_envs}",
            "rollout_config.worker_config.num_env_processes=2", "rollout_config.worker_config.device=cpu",
            f"rollout_config.worker_config.batch_size={batch_size or max(1, num_envs // 2)}",
            "rollout_config.replay_buffer_config.max_chunks=1000000",
            "rollout_config.replay_buffer_config.samples_per_insert=null", "rollout_config.to_send_queue_size=64",
            *overrides])
        if policy_kwargs is not None:
            config.policy_kwargs = policy_kwargs
        self.manager = RolloutManagerService(config, video_store=LocalBlobStore(workdir / "videos"))
        self.servers = [serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, self.manager, "m")])]
        registry = ModelRegistryService(LocalBlobStore(workdir / "registry"))
        self.servers.append(serve([(model_registry_pb2_grpc.add_ModelRegistryServicer_to_server, registry, "r")]))
        rb = config.rollout_config.replay_buffer_config
        buffer = ReplayBufferService(MemoryIndex(rb.max_chunks, 1000, 1000, 1), LocalBlobStore(workdir / "buffer"),
                                     "bench", config.rollout_config.fragment_length, 1, rb.max_chunks,
                                     lambda: self.manager._spaces)
        self.servers.append(serve([(replay_buffer_pb2_grpc.add_ReplayBufferServicer_to_server, buffer, "b")]))
        self.closers = [registry.stop, buffer.stop]
        ms, rs, bs = (s.address for s in self.servers)
        _, policy, _, _ = run_spaces(config)
        with ModelRegistryClient(rs) as registry_client:
            registry_client.publish(1, to_bytes(policy.state_dict()))
        with ReplayBufferClient(bs) as buffer_client:
            buffer_client.set_model_version(1)
        self.worker = RolloutWorker(ms, bs, rs)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        if not start:
            return
        self.thread.start()
        deadline = time.monotonic() + 30
        while self.worker.env_steps < 20 * num_envs and time.monotonic() < deadline:
            time.sleep(0.1)  # warm-up: imports, first resets

    def measure(self, seconds: float) -> dict[str, Any]:
        from prometheus_client import REGISTRY

        def hist(name: str) -> tuple[float, float]:
            return (REGISTRY.get_sample_value(f"{name}_sum") or 0.0, REGISTRY.get_sample_value(f"{name}_count") or 0.0)

        w = self.worker
        steps0, sent0, t0 = w.env_steps, w.sender.sent, time.monotonic()
        inf0, batch0 = hist("overworld_inference_latency_seconds"), hist("overworld_inference_batch_size")
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        inf1, batch1 = hist("overworld_inference_latency_seconds"), hist("overworld_inference_batch_size")
        calls = max(1.0, inf1[1] - inf0[1])
        return {"env_steps_per_second": (w.env_steps - steps0) / elapsed, "env_steps": w.env_steps - steps0,
                "fragments_sent": w.sender.sent - sent0, "seconds": elapsed,
                "mean_inference_ms": 1000 * (inf1[0] - inf0[0]) / calls,
                "mean_inference_batch": (batch1[0] - batch0[0]) / calls,
                "env_restarts": dict(w.pool.restarts)}

    def close(self) -> None:
        self.worker.stop_event.set()
        self.thread.join(30)
        self.worker.shutdown(10)
        for s in self.servers:
            s.stop(0)
        for c in self.closers:
            c()


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steps = sum(r["env_steps"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    out = dict(runs[-1])
    out.update(env_steps=steps, seconds=round(seconds, 2), env_steps_per_second=round(steps / seconds, 1),
               phases=[round(r["env_steps_per_second"], 1) for r in runs])
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0, help="per measured phase (6 phases + start-ups)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    logging.basicConfig(level=logging.WARNING)
    started = time.monotonic()
    kwargs = crafter_kwargs()
    d = args.seconds
    tiny = {"channels": [8], "hidden": 32, "recurrent": False}
    rows: dict[str, Any] = {}

    def worker(name: str, policy_kwargs: dict[str, Any], n: int, batch_size: int, tmp: str) -> None:
        bench = WorkerBench(policy_kwargs, n, Path(tmp) / name, batch_size=batch_size)
        try:
            rows[name] = {**bench.measure(d), "num_envs": n, "env_processes": 2, "batch_size": batch_size,
                          "process_local_groups": bench.worker.pool.process_local_groups,
                          "policy": policy_kwargs or "examples/crafter_cow.yaml's CNN"}
        finally:
            bench.close()

    with tempfile.TemporaryDirectory() as tmp:
        # the two bare phases bracket the others, so that a change of load from other processes shows
        bare_runs = [bare_processes(2, d, kwargs)]
        worker("rollout_worker_2_envs_tiny_cnn", tiny, 2, 1, tmp)
        worker("rollout_worker_16_envs_tiny_cnn", tiny, 16, 4, tmp)
        worker("rollout_worker_32_envs_tiny_cnn", tiny, 32, 8, tmp)
        rows["gymnasium_async_vector_env_2_envs"] = async_vector_env(2, d, kwargs)
        worker("rollout_worker_16_envs_crafter_cow_cnn", {}, 16, 4, tmp)
        bare_runs.append(bare_processes(2, d, kwargs))
    bare = merge(bare_runs)
    base = bare["env_steps_per_second"]
    for row in rows.values():
        row["env_steps_per_second"] = round(row["env_steps_per_second"], 1)
        row["fraction_of_bare"] = round(row["env_steps_per_second"] / base, 3)
    best = max(rows[k]["fraction_of_bare"] for k in rows if "tiny" in k)
    result = {
        "what": "env steps/s on Crafter (crafter_cow's env) with 2 env processes, same cores, same run",
        "load_average_at_end": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
        "bare_processes_2_envs_random_actions": bare,
        **rows,
        "target_fraction_of_bare": TARGET,
        "target_met": best >= TARGET,
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**provenance(), **result}, indent=2))  # provenance names the machine
    print(f"target_met {result['target_met']}  wall {result['wall_seconds']} s  load {result['load_average_at_end']}")
    for key, r in result.items():
        if isinstance(r, dict) and "env_steps_per_second" in r:
            frac = f"  ({r['fraction_of_bare']:.0%} of bare)" if "fraction_of_bare" in r else ""
            print(f"{key:<42} {r['env_steps_per_second']:8.1f} steps/s{frac}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
