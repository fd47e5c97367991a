"""The scale rehearsal: the chart rendered and run as pods (rehearsal/cluster.py) on rate-shaped
links, with a fleet of up to 32 rollout pods at Minecraft's pace (rehearsal/scale_standin.py), two
replay-buffer fronts, gae, the model-registry, the rollout-manager, Redis and the object store, and the
trainer; and what bench/bench_scale.py measures on them. Every pod runs from the image its manifest
names, built here (`make scale-images`): the rehearsal's, with the stand-in environment added to the
rollout-worker's and the trainer's as a user adds their own (rehearsal/scale-standin.Dockerfile).

    with Fleet.up(workdir, ImageStore.here(), workers=4, relay_fanout=2) as fleet:
        fleet.scale(8)
        fleet.wait_fleet(8)
        print(fleet.push_status(0))

Differences from the rehearsal (rehearsal/training_rehearsal.py), each to fit 32 pods into 2 cores:
- the trainer is one pod in local mode (`train_config.num_workers: 0`): the chart's RayJob head
  container with the entrypoint's `--ray-address auto` left out, and no run-controller or KubeRay (the
  rehearsal covers those; a Ray cluster costs minutes of both cores);
- the workers step their one environment in their own process (`env_backend: inprocess`).
Every pod's link is shaped (`LINK`, both ways), so the registry's, the trainer's and each worker's
bandwidth is a NIC's, not loopback's.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from overworld.core.security import tls
from overworld.core.wire import weights
from overworld.model_registry.client import ModelRegistryClient
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.run_controller.rayjob import build_rayjob
from overworld.v1 import model_registry_pb2, replay_buffer_pb2, rollout_manager_pb2
from rehearsal.chart import CHART, by_kind, render, values_from_files
from rehearsal.cluster import Cluster
from rehearsal.netns import netem_available, remove_leftovers, wait_until
from rehearsal.oci_images import REGISTRY as IMAGES
from rehearsal.oci_images import TAG, ImageStore
from rehearsal.pods import NAMESPACE, RELEASE, Pod, Workload
from rehearsal.training_rehearsal import SERVICE_AT_PORT, pod_images

STANDIN_IN_IMAGE = "/opt/overworld-standin/scale_standin.py"  # the same file in the scale images
SCALE_IMAGES = "localhost/overworld-scale"  # docker/images.mk's SCALE_IMAGES
LINK_MBIT = 200.0
LINK_DELAY_MS = 1.0  # applied where the kernel has netem (this machine's has not)
STORES = (f"{RELEASE}-redis", f"{RELEASE}-seaweedfs")
SERVICES = tuple(f"{RELEASE}-{name}" for name in ("rollout-manager", "model-registry", "gae", "replay-buffer"))
WORKERS = f"{RELEASE}-rollout-worker"
REGISTRY = f"{RELEASE}-model-registry"
BUFFER = f"{RELEASE}-replay-buffer"
TRAINER = f"{RELEASE}-trainer"
COMPONENTS = {"model-registry": REGISTRY, "rollout-manager": f"{RELEASE}-rollout-manager", "replay-buffer": BUFFER,
              "redis": f"{RELEASE}-redis", "object-store": f"{RELEASE}-seaweedfs", "gae": f"{RELEASE}-gae",
              "trainer": TRAINER}


def run_config(weights_mb: float, steps_per_iteration: int = 2048) -> dict[str, Any]:
    """The stand-in run: 32-step fragments, `steps_per_iteration` env steps per PPO iteration (one
    epoch of 8 minibatches), on-policy (each fragment trained on once)."""
    fragments = steps_per_iteration // 32
    return {
        "task_name": "standin", "seed": 0,
        "env_generator": f"{STANDIN_IN_IMAGE}:make_env", "policy_generator": f"{STANDIN_IN_IMAGE}:make_policy",
        "policy_kwargs": {"weights_mb": weights_mb},
        "rollout_config": {
            "num_rollout_workers": 1, "fragment_length": 32, "to_send_queue_size": 8,
            "worker_config": {"num_envs": 1, "num_env_processes": 1, "device": "cpu", "env_backend": "inprocess"},
            "replay_buffer_config": {
                "max_chunks": 4 * fragments, "max_reuse": 1, "max_staleness": 8, "fragments_per_chunk": 1,
                "samples_per_insert": 1.0, "samples_per_insert_error": float(2 * fragments),
                "min_size_to_sample": fragments // 8},
        },
        "train_config": {
            "num_workers": 0, "num_gpus_per_worker": 0, "num_iterations": 1_000_000,
            "learning_rate": 3e-4, "batch_size_per_gpu": fragments // 8, "batches_per_iteration": 8,
            "gradient_accumulation": 1, "epochs_per_iteration": 1, "context_length": 32, "discount": 0.95,
            "gae_lambda": 0.9, "ppo_clip": 0.2, "max_grad_norm": 0.5, "entropy_bonus_coef": 0.01,
            "kl_divergence_coef_rho": 0.0, "save_interval": 20, "keep_interval": 0},
        "logger_config": {"project": "overworld", "name": "scale", "wandb": False},
    }


def fleet_values(workers: int, relay_fanout: int, weights_mb: float) -> dict[str, Any]:
    values = values_from_files([CHART / "ci" / "cpu-values.yaml"])
    for component, repository in ((values, f"{IMAGES}/overworld-services"),
                                  (values["rolloutWorker"], f"{SCALE_IMAGES}/overworld-rollout-worker"),
                                  (values["trainer"], f"{SCALE_IMAGES}/overworld-trainer")):
        registry, _, name = repository.partition("/")
        component["image"] = {"registry": registry, "repository": name, "tag": TAG}
    values["run"] = {"config": run_config(weights_mb)}
    values["rolloutWorker"]["replicaCount"] = workers
    values["replayBuffer"]["replicaCount"] = 2
    values["redis"]["persistence"] = {"enabled": True}
    values["seaweedfs"]["persistence"] = {"enabled": True}
    values["modelRegistry"] = {"extraEnv": [{"name": "OVERWORLD_REGISTRY_RELAY_FANOUT", "value": str(relay_fanout)}]}
    values["trainingRun"] = {"resumeFrom": "latest"}
    return values


def trainer_workload(cluster: Cluster, objects: list[dict[str, Any]]) -> Workload:
    """The trainer as one pod: the RayJob head's container (image, environment, identity) that the
    run-controller would make for the chart's TrainingRun, running the entrypoint in local mode."""
    (training_run,) = by_kind(objects, "TrainingRun").values()
    head = build_rayjob(training_run, 1)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    spec = copy.deepcopy(head["spec"])
    container = spec["containers"][0]
    container["args"] = ["overworld", "serve", "trainer", "--resume", "latest"]
    container.pop("lifecycle", None)  # its preStop stops a Ray job; here SIGTERM reaches the trainer
    template = cluster.template_from_pod_spec(spec, {**head["metadata"]["labels"], "app.kubernetes.io/component": "trainer"})
    template.grace = 30.0
    template.readiness = ("tcp", 50055, "")  # its gRPC port (the head's probe checks Ray, which is not here)
    return Workload(TRAINER, "Deployment", template, 1)


class Fleet:
    def __init__(self, workdir: Path, store: ImageStore, workers: int, relay_fanout: int, weights_mb: float,
                 link_mbit: float = LINK_MBIT) -> None:
        self.objects = render(fleet_values(workers, relay_fanout, weights_mb), release=RELEASE, namespace=NAMESPACE)
        delay = LINK_DELAY_MS if netem_available() else 0.0
        self.link = (link_mbit, delay)
        self.cluster = Cluster(self.objects, workdir, link=self.link, images=pod_images(self.objects, store))
        self.relay_fanout, self.weights_mb = relay_fanout, weights_mb
        self._channels: dict[str, Any] = {}

    @classmethod
    @contextlib.contextmanager
    def up(cls, workdir: Path, store: ImageStore, workers: int, relay_fanout: int,
           weights_mb: float = 48.0) -> Iterator[Fleet]:
        remove_leftovers()
        shutil.rmtree(workdir, ignore_errors=True)  # a killed earlier run's pods and certificates
        fleet = cls(workdir, store, workers, relay_fanout, weights_mb)
        try:
            fleet.start()
            yield fleet
        finally:
            for channel in fleet._channels.values():
                channel.close()
            fleet.cluster.stop()
            shutil.rmtree(workdir, ignore_errors=True)

    def start(self) -> None:
        cluster = self.cluster
        cluster.start()
        workloads = cluster.start_release(STORES, SERVICES)
        cluster.add_workload(trainer_workload(cluster, self.objects))
        cluster.add_workload(cluster.workload_from_manifest(workloads[WORKERS]))

    def wait_ready(self, owners: tuple[str, ...], timeout: float) -> None:
        self.cluster.wait_ready(owners, timeout)

    # --- the fleet --------------------------------------------------------------------------------

    def scale(self, workers: int) -> None:
        self.cluster.scale(WORKERS, workers)

    def worker_pods(self) -> list[Pod]:
        return self.cluster.pods_of(WORKERS)

    def wait_fleet(self, workers: int, timeout: float = 600) -> None:
        """`workers` worker pods ready, registered with the manager, and watching the registry."""
        def settled() -> bool:
            pods = self.worker_pods()
            if len(pods) != workers or not all(p.ready for p in pods):
                return False
            fleet = self.fleet_status()
            return len(fleet.workers) == workers and self.push_status(0).connected_watchers == workers

        try:
            wait_until(settled, timeout, f"{workers} rollout workers registered and watching", interval=2)
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{self.cluster.logs(WORKERS, tail=1500)}") from err

    def stop_trainer(self) -> None:
        """Scale the trainer to 0 and wait for it to have exited (checkpoint written, last version
        published)."""
        self.cluster.scale(TRAINER, 0)
        wait_until(lambda: all(p.phase == "Terminated" for p in self.cluster.pods_of(TRAINER, include_ended=True)),
                   120, "the trainer pod gone")

    def start_trainer(self) -> None:
        self.cluster.scale(TRAINER, 1)

    # --- calls, as the operator (through port-forwards) -----------------------------------------------

    def _channel(self, target: str, port: int, identity: str = "operator") -> Any:
        key = f"{identity}@{target}:{port}"
        if key not in self._channels:
            directory = self.cluster.workdir / "identities" / identity
            if not directory.is_dir():
                directory.mkdir(parents=True)
                for name, text in self.cluster.secrets[f"{RELEASE}-tls-{identity}"].items():
                    (directory / name).write_text(text)
            cert, key_pem, ca = tls.CredentialFiles(directory).pems
            self._channels[key] = grpc.secure_channel(
                self.cluster.forward(target, port), grpc.ssl_channel_credentials(ca, key_pem, cert),
                options=[("grpc.ssl_target_name_override", tls.server_name(SERVICE_AT_PORT[port])),
                         ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)])
        return self._channels[key]

    def push_status(self, version: int, wait: float = 0.0) -> model_registry_pb2.PushStatus:
        registry = ModelRegistryClient(REGISTRY, channel=self._channel(REGISTRY, 50054))
        return registry.push_status(version, wait=wait, timeout=wait + 30)

    def fleet_status(self) -> rollout_manager_pb2.FleetStatus:
        manager = f"{RELEASE}-rollout-manager"
        return RolloutManagerClient(manager, channel=self._channel(manager, 50051)).fleet_status(timeout=10)

    def buffer_stats(self, pod: Pod) -> replay_buffer_pb2.BufferStats:
        return ReplayBufferClient(pod.ip, channel=self._channel(pod.ip, 50052)).stats(timeout=10)

    def latest_version(self) -> int:
        versions = ModelRegistryClient(REGISTRY, channel=self._channel(REGISTRY, 50054)).list_versions(timeout=10)
        return max((v.version for v in versions), default=0)

    def publish(self, version: int, state: dict[str, Any]) -> None:
        """Publish a version as the trainer would (its identity, through a forward to the registry)."""
        client = ModelRegistryClient(REGISTRY, channel=self._channel(REGISTRY, 50054, identity="trainer"))
        client.publish(version, weights.to_bytes(state), timeout=300)

    # --- what Prometheus and the kernel would tell ----------------------------------------------------

    def metrics(self, pod: Pod, port: int = 9090) -> dict[str, float]:
        """A pod's Prometheus metrics, as a scrape reads them: name{labels} -> value."""
        return self.cluster.scrape(pod, port)

    def usage(self, owner: str) -> list[dict[str, Any]]:
        """CPU seconds used so far, RSS and PSS bytes and open file descriptors of each pod of `owner`
        (every process in the pod)."""
        ticks = os.sysconf("SC_CLK_TCK")
        out = []
        for pod in self.cluster.pods_of(owner):
            cpu = rss = pss = fds = 0.0
            for pid in _pids(pod.host.netns):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    cpu += (int(stat[11]) + int(stat[12])) / ticks
                    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                        if line.startswith("Rss:"):
                            rss += int(line.split()[1]) * 1024
                        elif line.startswith("Pss:"):
                            pss += int(line.split()[1]) * 1024
                    fds += len(os.listdir(f"/proc/{pid}/fd"))
            out.append({"pod": pod.name, "cpu_seconds": cpu, "rss_bytes": rss, "pss_bytes": pss, "fds": fds,
                        "t": time.monotonic()})
        return out


def _pids(netns: str) -> list[int]:
    import subprocess

    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30, check=False)
    return [int(p) for p in out.stdout.split()]
