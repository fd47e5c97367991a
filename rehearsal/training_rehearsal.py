"""The rehearsal: the chart rendered with CPU values and a CartPole run, brought up as pods from the
images built here (rehearsal/oci_images.py), and the calls a person (or a dashboard) would make to see
how it is doing.

    with Rehearsal.up(workdir, ImageStore.here()) as rehearsal:
        rehearsal.wait_training(versions=3)
        rehearsal.delete("overworld-gae")
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import yaml

from overworld.core.security import tls
from overworld.model_registry.client import ModelRegistryClient
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.serve import DEFAULT_PORTS
from overworld.trainer.client import TrainerClient
from overworld.v1 import replay_buffer_pb2, rollout_manager_pb2, trainer_pb2
from rehearsal.chart import CHART, by_kind, render, values_from_files
from rehearsal.cluster import Cluster
from rehearsal.kuberay import KubeRay
from rehearsal.netns import Network, remove_leftovers, wait_until
from rehearsal.oci_images import OBJECT_STORE, REDIS, REGISTRY, TAG, Image, ImageStore
from rehearsal.pods import NAMESPACE, RELEASE, REPO, Pod, Volume, Workload
from rehearsal.prometheus import MONITORING, Prometheus

RUN = RELEASE  # the TrainingRun the chart creates
STORES = (f"{RELEASE}-redis", f"{RELEASE}-seaweedfs")
SERVICES = tuple(f"{RELEASE}-{name}" for name in ("rollout-manager", "model-registry", "gae", "replay-buffer",
                                                   "rollout-worker"))
CONTROLLER = f"{RELEASE}-run-controller"
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"

SERVICE_AT_PORT = {port: service for service, port in DEFAULT_PORTS.items()}  # whose certificate it shows


SCRAPE_INTERVAL = 5.0  # seconds: the monitors' interval, and Prometheus' rule evaluation
LEARNER_STALL_SECONDS = 60  # the schema's least


def rehearsal_values() -> dict[str, Any]:
    """The CPU values of the chart, the images built for the tests (the CPU-only torch), a CartPole run
    that checkpoints and logs to the object store, two replay-buffer fronts, stores on volumes, a
    one-worker Ray cluster whose worker declares a GPU, the chart's NetworkPolicies, and its monitors and
    alerts as ci/monitoring-values.yaml turns them on (metrics scraped from the `monitoring` namespace
    only), scraped every 5 s, OverworldWorkersDown and OverworldLearnerStalled firing after 10 s instead
    of minutes."""
    values = values_from_files([CHART / "ci" / "cpu-values.yaml"])
    registry, _, namespace = REGISTRY.partition("/")
    for component, role in ((values, "services"), (values["rolloutWorker"], "rollout-worker"),
                            (values["trainer"], "trainer")):  # as a user's values name their images
        component["image"] = {"registry": registry, "repository": f"{namespace}/overworld-{role}", "tag": TAG}
    config = yaml.safe_load((REPO / "examples" / "cartpole.yaml").read_text())
    # save_path: the chart's (--save-path / OVERWORLD_SAVE_PATH, the object store) replaces the config's.
    config["train_config"].update(num_workers=1,  # on the cluster's worker group, not the head (local mode)
                                  save_interval=5, keep_interval=0, num_iterations=100000)
    config["logger_config"]["tensorboard"] = True  # files for the trainer to sync to the object store
    values["run"] = {"config": config}
    values["rolloutWorker"]["replicaCount"] = 1
    values["replayBuffer"]["replicaCount"] = 2
    values["redis"]["persistence"] = {"enabled": True}
    values["seaweedfs"]["persistence"] = {"enabled": True}
    values["trainer"]["workerGroup"].update(replicas=1, gpus=1)
    values["trainingRun"] = {"resumeFrom": ""}
    values["runController"] = {"progressIntervalSeconds": 2}
    # enforced between the pods (rehearsal/network_policy.py)
    values["networkPolicy"] = {"enabled": True, "metricsNamespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": MONITORING}}}
    every = {"interval": f"{SCRAPE_INTERVAL:g}s", "scrapeTimeout": f"{SCRAPE_INTERVAL - 1:g}s"}
    short = {"workersDown": "10s", "learnerStalled": "10s"}  # the alerts the rehearsal makes fire
    values["metrics"] = {"serviceMonitor": {"enabled": True, **every}, "podMonitor": {"enabled": True, **every},
                         "prometheusRule": {"enabled": True, "learnerStallSeconds": LEARNER_STALL_SECONDS,
                                            "pendingFor": short}}
    return values


def pod_images(objects: list[dict[str, Any]], store: ImageStore) -> dict[str, Image]:
    """Every image the release's pods name (the TrainingRun's, for the RayJob, too), as built here; the
    chart's Redis and SeaweedFS by their stand-ins."""
    stand_ins = {"redis": REDIS, "seaweedfs": OBJECT_STORE}
    named: set[str] = set()
    for obj in objects:
        if obj["kind"] == "TrainingRun":
            named.add(obj["spec"]["image"])
        template = (obj.get("spec") or {}).get("template") or {}
        named.update(c["image"] for c in (template.get("spec") or {}).get("containers") or [])
    images = {}
    for reference in sorted(named):
        stand_in = next((ref for name, ref in stand_ins.items() if f"/{name}:" in reference), None)
        images[reference] = store.image(stand_in or reference)
    return images


class Rehearsal:
    def __init__(self, workdir: Path, store: ImageStore, values: dict[str, Any] | None = None) -> None:
        """`values`: the chart's (default: rehearsal_values())."""
        self.objects = render(values or rehearsal_values(), release=RELEASE, namespace=NAMESPACE)
        self.cluster = Cluster(self.objects, workdir, images=pod_images(self.objects, store))
        # the node's device plugin declares one GPU: the Ray worker group's pod asks for it
        self.cluster.node_resources = {"nvidia.com/gpu": 1}
        self.kuberay = KubeRay(self.cluster)
        self.cluster.kuberay = self.kuberay
        self.prometheus = Prometheus(self.cluster, self.objects, SCRAPE_INTERVAL)
        self._ray_cluster = ""  # the RayCluster the trainer was last found on

    @classmethod
    @contextlib.contextmanager
    def up(cls, workdir: Path, store: ImageStore, values: dict[str, Any] | None = None) -> Iterator[Rehearsal]:
        remove_leftovers()
        rehearsal = cls(workdir, store, values)
        try:
            rehearsal.start()
            yield rehearsal
        finally:
            try:
                rehearsal.prometheus.stop()
            finally:
                rehearsal.cluster.stop()
                shutil.rmtree(workdir, ignore_errors=True)

    # --- bring-up, in the order a cluster settles into anyway ----------------------------------

    def start(self) -> None:
        from rehearsal.server_binaries import locate

        cluster = self.cluster
        cluster.start()
        self.prometheus.start(str(locate("prometheus")))  # watching from the first pod on
        workloads = cluster.start_release(STORES, SERVICES, 120)
        controller = cluster.workload_from_manifest(workloads[CONTROLLER])
        # the controller's ServiceAccount token, if the chart mounts one, with what the chart's Role grants
        kubeconfig = cluster.service_account_kubeconfig(workloads[CONTROLLER]["spec"]["template"]["spec"])
        if kubeconfig is not None:  # where the kubelet mounts the ServiceAccount's token
            controller.template.volumes.append(Volume(SERVICE_ACCOUNT_MOUNT, "dir", kubeconfig.parent, read_only=True))
            controller.template.env["KUBECONFIG"] = f"{SERVICE_ACCOUNT_MOUNT}/{kubeconfig.name}"
        cluster.add_workload(controller)
        manifest = cluster.workdir / "trainingrun.yaml"
        (training_run,) = by_kind(self.objects, "TrainingRun").values()
        manifest.write_text(yaml.safe_dump(training_run))
        cluster.kubectl("create", "-f", str(manifest))  # validated as the API server would (api_validation.py)

    def wait_ready(self, owners: tuple[str, ...], timeout: float) -> None:
        self.cluster.wait_ready(owners, timeout)

    # --- what kubectl and the dashboards would show --------------------------------------------

    def rayjob(self, name: str | None = None) -> dict[str, Any]:
        run = json.loads(self.cluster.kubectl("get", "trainingrun", RUN, "-o", "json"))
        job_name = name or (run.get("status") or {}).get("rayJob")
        assert job_name, f"TrainingRun has no RayJob yet: {run.get('status')}"
        job: dict[str, Any] = json.loads(self.cluster.kubectl("get", "rayjob", job_name, "-o", "json"))
        return job

    def training_run(self) -> dict[str, Any]:
        run: dict[str, Any] = json.loads(self.cluster.kubectl("get", "trainingrun", RUN, "-o", "json"))
        return run

    def identity(self, name: str) -> Path:
        """A directory with the certificate of identity `name`, from its rendered Secret (as a person
        copies the operator's out of the cluster for `overworld status`)."""
        directory = self.cluster.workdir / "identities" / name
        if not directory.is_dir():
            directory.mkdir(parents=True)
            for key, text in self.cluster.secrets[f"{RELEASE}-tls-{name}"].items():
                (directory / key).write_text(text)
        return directory

    def _channel(self, target: str, port: int) -> grpc.Channel:
        """A channel over mutual TLS as the operator (`overworld status`'s identity), through a forward."""
        cert, key, ca = tls.CredentialFiles(self.identity("operator")).pems
        return grpc.secure_channel(self.cluster.forward(target, port), grpc.ssl_channel_credentials(ca, key, cert),
                                   options=[("grpc.ssl_target_name_override",
                                             tls.server_name(SERVICE_AT_PORT[port]))])

    def registry_version(self) -> int:
        registry = f"{RELEASE}-model-registry"
        with self._channel(registry, 50054) as channel:
            versions = ModelRegistryClient(registry, channel=channel).list_versions(timeout=5)
        return max((v.version for v in versions), default=0)

    def trainer_status(self) -> trainer_pb2.TrainerStatus:
        """The trainer's status, from the Ray head of the TrainingRun's current RayJob. Which RayCluster
        that is (two kubectl calls) is looked up again only when the one known last does not answer:
        the tests poll this, and kubectl costs a busy core a fraction of a second each time."""
        for attempt in range(2):
            if attempt or not self._ray_cluster:
                self._ray_cluster = (self.rayjob().get("status") or {}).get("rayClusterName") or ""
                assert self._ray_cluster, "no RayCluster yet"
            head = f"{self._ray_cluster}-head-svc"
            try:
                with self._channel(head, 50055) as channel:
                    return TrainerClient(head, channel=channel).status(timeout=5)
            except grpc.RpcError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def fleet(self) -> rollout_manager_pb2.FleetStatus:
        manager = f"{RELEASE}-rollout-manager"
        with self._channel(manager, 50051) as channel:
            return RolloutManagerClient(manager, channel=channel).fleet_status(timeout=5)

    def buffer_stats(self, pod: Pod) -> replay_buffer_pb2.BufferStats:
        with self._channel(pod.ip, 50052) as channel:
            return ReplayBufferClient(pod.ip, channel=channel).stats(timeout=5)

    def metrics(self, pod: Pod, port: int = 9090) -> dict[str, float]:
        """A pod's Prometheus metrics, as a scrape reads them: name{labels} -> value."""
        return self.cluster.scrape(pod, port)

    def object_keys(self, url: str) -> list[str]:
        """The object store's keys under an s3:// URL, listed from a replay-buffer pod (it has the
        store's address and keys)."""
        script = ("import sys; from overworld.core.blobs.urls import open_blob_store; "
                  "print('\\n'.join(open_blob_store(sys.argv[1]).keys()))")
        return self.exec(self.cluster.pod(f"{RELEASE}-replay-buffer"), "python", "-c", script, url).split()

    def exec(self, pod: Pod, *argv: str) -> str:
        return self.cluster.exec(pod, *argv)

    def redis_meta(self) -> dict[str, str]:
        """The replay index's counters in Redis (inserted, sampled, ...), through redis-cli in its pod."""
        redis_pod = self.cluster.pod(f"{RELEASE}-redis")
        keys = self.exec(redis_pod, "redis-cli", "--scan", "--pattern", "ow:rb:*meta").split()
        assert len(keys) == 1, keys
        fields = self.exec(redis_pod, "redis-cli", "hgetall", keys[0]).split()
        return dict(zip(fields[::2], fields[1::2], strict=True))

    # --- waiting for training ----------------------------------------------------------------

    def wait_training(self, beyond: int = 0, timeout: float = 300.0) -> int:
        """Wait until the registry holds a model version above `beyond`; return it."""
        def newer() -> int:
            version = self.registry_version()
            return version if version > beyond else 0

        try:
            return int(wait_until(newer, timeout, f"a model version above {beyond}", interval=1.0))
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{self.cluster.logs(tail=2500)}") from err

    def workload(self, name: str) -> Workload:
        return self.cluster.workloads[name]


__all__ = ["Network", "Rehearsal", "rehearsal_values"]


# A rollout worker's last line of its stop (rollout_worker/worker.py): its flush and its ledger.
FLUSHED = re.compile(r"sender flushed: (True|False) \((\d+) complete fragments, (\d+) acknowledged, (\d+) rejected.*"
                     r"stopping threw away (\d+) env steps")


def worker_stops(pod: Pod) -> list[dict[str, Any]]:
    """Each stop of the rollout worker in this pod: flushed, complete fragments, acknowledged by the
    replay buffer, rejected, env steps thrown away."""
    return [{"flushed": m.group(1) == "True", "complete": int(m.group(2)), "acknowledged": int(m.group(3)),
             "rejected": int(m.group(4)), "thrown_away_env_steps": int(m.group(5))}
            for m in FLUSHED.finditer(pod.log.read_text(errors="replace"))]
