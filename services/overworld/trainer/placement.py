"""Where the Ray Train workers run, decided from the config and the cluster, never from the driver.

On KubeRay the driver is the RayJob entrypoint on the head pod, which has no GPU; whether a worker
gets one follows `train_config.num_gpus_per_worker` alone. Before Ray Train starts, `reserve_workers`
asks the cluster for every worker's bundle (a placement group, so that an autoscaling cluster sees
the demand and adds GPU nodes) and waits at most `placement_timeout` seconds; a cluster this driver
started itself cannot grow, so there it does not wait. Then a probe runs in each GPU bundle: Ray
handing out a GPU on a node whose processes cannot use CUDA is an error, never a CPU run.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("overworld.trainer")

LOCAL_PLACEMENT_SECONDS = 60.0  # a fixed cluster that has the resources places a bundle in well under this
PROBE_TIMEOUT_SECONDS = 300.0  # a probe imports torch in a fresh worker process: slow, but bounded
PROGRESS_SECONDS = 30.0


class PlacementError(RuntimeError):
    """The trainer's workers cannot be placed as configured; starting again would not help."""


def local_mode_device(num_gpus_per_worker: float) -> Any:
    """The learner's device in Ray Train's local mode (`train_config.num_workers: 0`, the learner in the
    trainer's own process): this process's first GPU exactly when `num_gpus_per_worker > 0`, and an
    error, never a CPU run, when CUDA is not usable here."""
    import torch

    if num_gpus_per_worker <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise PlacementError(
            f"train_config.num_gpus_per_worker={num_gpus_per_worker:g} with num_workers=0 (Ray Train's local mode) "
            f"trains on this process's GPU, but CUDA is not usable here ({build}; torch.cuda.is_available() is "
            "False). Refusing to train on CPU: set train_config.num_gpus_per_worker=0 to train on CPU "
            "deliberately, or num_workers >= 1 to train on a Ray cluster's GPUs")
    return torch.device("cuda", 0)


def torch_trainer_class(own_ray: bool) -> type:
    """Ray Train's TorchTrainer; on a Ray this driver started itself, without the PlacementGroupCleaner.

    That cleaner is a detached actor that asks the dashboard's State API every second whether the
    Train controller still lives, so that a crashed controller's placement group is freed on a long-lived
    cluster. A Ray this driver started has no dashboard (LOCAL_RAY_INIT) and dies with the driver: the
    cleaner could only log "State API may be temporarily unavailable" every second for the whole run."""
    from ray.train.torch import TorchTrainer

    if not own_ray:
        return TorchTrainer
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class OwnRayTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list:
            return [c for c in super()._create_default_callbacks()  # type: ignore[misc]  # typed as Train v1's TorchTrainer; v2's has it
                    if not isinstance(c, PlacementGroupCleanerCallback)]

    return OwnRayTorchTrainer


def worker_resources(num_gpus_per_worker: float) -> dict[str, float]:
    return {"CPU": 1.0, **({"GPU": float(num_gpus_per_worker)} if num_gpus_per_worker > 0 else {})}


def describe_cluster() -> str:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    parts = [f"{n.get('NodeManagerAddress', '?')} ({n['NodeID'][:8]}): {n.get('Resources', {}).get('GPU', 0):g} GPU, "
             f"{n.get('Resources', {}).get('CPU', 0):g} CPU" for n in nodes]
    return "; ".join(parts) or "no live node"


def _shortfall(num_workers: int, resources: dict[str, float]) -> str:
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    asked = {k: v * num_workers for k, v in resources.items()}
    return (f"train_config.num_workers={num_workers} x {resources} asks for "
            + ", ".join(f"{v:g} {k}" for k, v in asked.items())
            + "; the Ray cluster has " + ", ".join(f"{total.get(k, 0):g} {k} ({free.get(k, 0):g} free)" for k in asked)
            + f" [nodes: {describe_cluster()}]")


def _missing(num_workers: int, resources: dict[str, float]) -> bool:
    import ray

    total = ray.cluster_resources()
    return any(total.get(k, 0.0) + 1e-9 < v * num_workers for k, v in resources.items())


def require_usable_cuda() -> dict[str, Any]:
    """In a Ray worker process: when Ray assigned it GPUs, CUDA must be usable there (an error, never
    a CPU fallback). Returns what it saw: node, Ray's GPU ids, torch's CUDA."""
    import ray
    import torch

    node_id = ray.get_runtime_context().get_node_id()
    ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "?")
    seen: dict[str, Any] = {"node_id": node_id, "ip": ip, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda": torch.cuda.is_available(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if seen["gpu_ids"] and not seen["cuda"]:
        build = f"torch {seen['torch']}" + ("" if seen["torch_cuda"] else ", a CPU-only build")
        raise PlacementError(
            f"Ray assigned GPU {', '.join(seen['gpu_ids'])} on node {seen['ip']} ({seen['node_id']}) to a trainer "
            f"worker, but CUDA is not usable there ({build}; torch.cuda.is_available() is False). Refusing to "
            "train on CPU: fix the node's GPU driver, device plugin or image, or set "
            "train_config.num_gpus_per_worker=0 to train on CPU deliberately")
    return seen


def reserve_workers(num_workers: int, resources: dict[str, float], timeout: float) -> list[dict[str, Any]]:
    """Wait until the cluster can place `num_workers` bundles of `resources` (at most `timeout`
    seconds; 0: the cluster cannot grow, fail at once when it lacks them), probe each GPU bundle,
    then release the reservation for Ray Train. Returns the probes (empty without GPUs)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if timeout <= 0 and _missing(num_workers, resources):
        raise PlacementError(_shortfall(num_workers, resources))
    # PACK, as Ray Train places its workers: a bundle that fits here fits there.
    group = placement_group([dict(resources)] * num_workers, strategy="PACK")
    try:
        started = time.monotonic()
        deadline = started + (timeout if timeout > 0 else LOCAL_PLACEMENT_SECONDS)
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait([group.ready()], timeout=max(0.0, min(PROGRESS_SECONDS, left)))
            if ready:
                break
            if time.monotonic() >= deadline:
                raise PlacementError(f"no placement after {time.monotonic() - started:.0f}s "
                                     f"(train_config.placement_timeout={timeout:g}): {_shortfall(num_workers, resources)}")
            log.info("waiting for the Ray cluster to offer the trainer workers' resources (%.0fs left): %s",
                     left, _shortfall(num_workers, resources))
        if "GPU" not in resources:
            return []
        probe = ray.remote(require_usable_cuda)
        refs = [probe.options(num_cpus=resources["CPU"], num_gpus=resources["GPU"], max_retries=0,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
                for i in range(num_workers)]
        try:
            found = ray.get(refs, timeout=PROBE_TIMEOUT_SECONDS)
        except ray.exceptions.RayTaskError as err:  # the probe's PlacementError, without Ray's wrapping
            raise PlacementError(str(getattr(err, "cause", None) or err)) from None
        log.info("trainer workers' GPUs: %s", ", ".join(f"{f['ip']} GPU {','.join(f['gpu_ids'])}" for f in found))
        return found
    finally:
        remove_placement_group(group)
