"""The chart's wiring is the code's: render the chart, take each container's command, arguments
and environment exactly as rendered, and start the real services with them on this machine.

The only translation is what a cluster would do for us: Service DNS names (and their ports)
map to loopback ports, Secrets (the Helm-generated certificates and passwords) and the run-config
ConfigMap are resolved from the rendered objects, the bundled Redis and object store are a real
redis-server (with the rendered password) and an S3-protocol server on loopback (the bucket is made
as the hook Job makes it), and the trainer's RayJob cluster (`--ray-address auto`) is a local Ray
(`--ray-address ""`). Then the services must pass their probes (plaintext, on the health port, as
kubelet sends them) and training must advance over mutual TLS: the model registry, asked with the
rendered operator certificate, holds a version above 1 (version 1 is the initial weights, published
before any update: version 2 needs a whole iteration through every service).
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2

from overworld.core.grpc_util import health_status
from overworld.core.security import tls
from overworld.model_registry.client import ModelRegistryClient
from overworld.run_controller.rayjob import build_rayjob
from tests.conftest import RedisServer
from tests.deploy.deploy_support import CHART, REPO, SERVICES, by_kind, containers, render, values_from_files
from tests.support import free_port, stop_process

RELEASE = "overworld"
TRAINING_TIMEOUT = 420.0


def chart_values() -> dict[str, Any]:
    values = values_from_files([CHART / "ci" / "cpu-values.yaml"])
    config = yaml.safe_load((REPO / "examples" / "cartpole.yaml").read_text())
    config["train_config"]["num_workers"] = 1  # a Ray Train worker of the cluster, as on KubeRay
    values["run"] = {"config": config}
    values["rolloutWorker"]["replicaCount"] = 1
    return values


class Cluster:
    """What Kubernetes would provide: DNS, Secrets, ConfigMap mounts, the bundled stores."""

    def __init__(self, objects: list[dict[str, Any]], tmp: Path, redis_port: int, s3_port: int) -> None:
        self.objects = objects
        self.tmp = tmp
        self.ports: dict[tuple[str, int], int] = {}
        for name, service in by_kind(objects, "Service").items():
            for port in service["spec"]["ports"]:
                # A headless Service reaches the same pods as its ClusterIP twin.
                key = (name.removesuffix("-headless"), port["port"])
                self.ports[(name, port["port"])] = self.ports.setdefault(key, free_port())
        self.ports[(f"{RELEASE}-redis", 6379)] = redis_port
        self.ports[(f"{RELEASE}-seaweedfs", 8333)] = s3_port
        self.secrets = {
            name: {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
            for name, secret in by_kind(objects, "Secret").items()
        }

    def address(self, text: str) -> str:
        """Replace every `<service>:<port>` of a rendered Service with its loopback address."""

        def swap(match: re.Match[str]) -> str:
            key = (match[1], int(match[2]))
            return f"127.0.0.1:{self.ports[key]}" if key in self.ports else match[0]

        return re.sub(r"\b([a-z0-9-]+):(\d+)\b", swap, text)

    def mounts(self, deployment: dict[str, Any], container: dict[str, Any]) -> dict[str, Path]:
        """ConfigMap and Secret volumes written to files; emptyDirs as fresh directories."""
        return self.volume_dirs(deployment["metadata"]["name"], deployment["spec"]["template"]["spec"], container)

    def volume_dirs(self, owner: str, pod_spec: dict[str, Any], container: dict[str, Any]) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        mapped: dict[str, Path] = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            target = self.tmp / owner / mount["name"]
            target.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                config_map = by_kind(self.objects, "ConfigMap")[volume["configMap"]["name"]]
                for key, text in config_map["data"].items():
                    (target / key).write_text(text)
            if "secret" in volume:
                for key, text in self.secrets[volume["secret"]["secretName"]].items():
                    (target / key).write_text(text)
            mapped[mount["mountPath"]] = target
        return mapped

    def environment(
        self, env: list[dict[str, Any]], mounts: dict[str, Path], own_port: int
    ) -> dict[str, str]:
        result: dict[str, str] = {}
        for item in env:
            if (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                value = "127.0.0.1"  # every "pod" of this test is on this machine's loopback
            elif "valueFrom" in item:
                ref = item["valueFrom"]["secretKeyRef"]
                value = self.secrets[ref["name"]][ref["key"]]
            else:
                value = str(item["value"])
            for mount_path, local in mounts.items():
                if value == mount_path or value.startswith(mount_path + "/"):
                    value = str(local) + value[len(mount_path) :]
            result[item["name"]] = self.address(value)
        # The pod's own ports: its Service port, and a metrics port of its own (pods do not share).
        result["OVERWORLD_HOST"] = "127.0.0.1"
        result["OVERWORLD_PORT"] = str(own_port)
        if "OVERWORLD_HEALTH_PORT" in result:
            result["OVERWORLD_HEALTH_PORT"] = str(free_port())
        if result.get("OVERWORLD_METRICS_PORT", "0") != "0":
            result["OVERWORLD_METRICS_PORT"] = str(free_port())
        return result


def process_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERWORLD_")}
    env.update(extra)
    env["no_proxy"] = "127.0.0.1,localhost"
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        env.pop(var, None)
    return env


def healthy(address: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with grpc.insecure_channel(address) as plaintext:
        while time.monotonic() < deadline:
            try:
                if health_status(plaintext, timeout=2) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.5)
    raise AssertionError(f"{address} not SERVING after {timeout}s: {last}")


def latest_version(address: str) -> int:
    with ModelRegistryClient(address) as registry:  # as the operator (tls.use)
        versions = registry.list_versions(timeout=5)
    return max((v.version for v in versions), default=0)


@pytest.mark.slow
def test_rendered_services_find_each_other_and_train(tmp_path: Path, s3_server: dict[str, str]) -> None:
    from minio import Minio

    objects = render(chart_values(), release=RELEASE, namespace="rl")
    secrets = by_kind(objects, "Secret")
    password = base64.b64decode(secrets[f"{RELEASE}-redis"]["data"]["redis-password"]).decode()
    redis_server = RedisServer(tmp_path / "redis", password=password)  # the bundled Redis, locked as rendered
    redis_server.start()
    cluster = Cluster(
        objects, tmp_path, redis_server.port, int(s3_server["OVERWORLD_S3_ENDPOINT"].rsplit(":", 1)[1])
    )
    operator = tmp_path / "operator-tls"  # what `kubectl get secret overworld-tls-operator` gives a person
    operator.mkdir()
    for key, text in cluster.secrets[f"{RELEASE}-tls-operator"].items():
        (operator / key).write_text(text)
    tls.use(operator)
    deployments = by_kind(objects, "Deployment")

    # The bucket, as the post-install hook Job makes it (same endpoint, keys and bucket name).
    (job,) = by_kind(objects, "Job").values()
    job_env = cluster.environment(containers(job)[0]["env"], {}, 0)
    endpoint = job_env["S3_ENDPOINT"].removeprefix("http://")
    store = Minio(
        endpoint, access_key=job_env["S3_ACCESS_KEY"], secret_key=job_env["S3_SECRET_KEY"], secure=False
    )
    if not store.bucket_exists(job_env["BUCKET"]):
        store.make_bucket(job_env["BUCKET"])

    processes: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(name: str, argv: list[str], env: dict[str, str]) -> None:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, env=process_env(env), stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path
            )
        processes.append((name, proc, log))

    def logs() -> str:
        return "\n".join(
            f"--- {name} (exit {p.poll()}):\n{log.read_text()[-3000:]}" for name, p, log in processes
        )

    try:
        addresses: dict[str, str] = {}
        probes: dict[str, str] = {}
        order = ["rollout-manager", "model-registry", "gae", "replay-buffer", "rollout-worker"]
        assert set(order) == set(SERVICES)
        for component in order:
            deployment = deployments[f"{RELEASE}-{component}"]
            assert deployment["spec"]["replicas"] == 1
            (container,) = containers(deployment)
            grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
            own = cluster.ports.get((f"{RELEASE}-{component}", grpc_port)) or free_port()
            env = cluster.environment(container["env"], cluster.mounts(deployment, container), own)
            # No command: the image's entrypoint, `overworld` (docker/services.Dockerfile).
            start(component, [shutil_which("overworld"), *container["args"]], env)
            addresses[component] = f"127.0.0.1:{own}"
            probe_port = container["readinessProbe"]["grpc"]["port"]
            assert probe_port == int(next(e["value"] for e in container["env"] if e["name"] == "OVERWORLD_HEALTH_PORT"))
            probes[component] = f"127.0.0.1:{env['OVERWORLD_HEALTH_PORT']}"
            healthy(probes[component])

        # The trainer: the RayJob the run-controller makes from the rendered TrainingRun.
        (training_run,) = by_kind(objects, "TrainingRun").values()
        rayjob = build_rayjob(training_run, attempt=1, resume_from=training_run["spec"]["resumeFrom"])
        head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        exec_word, *argv = shlex.split(rayjob["spec"]["entrypoint"])  # Ray's /bin/sh -c execs the trainer
        assert exec_word == "exec" and argv[:5] == ["overworld", "serve", "trainer", "--ray-address", "auto"]
        argv[4] = ""  # the RayJob's cluster, played by a local Ray
        trainer_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "trainer")
        head_mounts = cluster.volume_dirs("trainer", rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"],
                                          head)
        head_mounts["/tmp"] = tmp_path / "trainer-tmp"
        trainer_env = cluster.environment(head["env"], head_mounts, free_port())
        assert trainer_env["OVERWORLD_ROLLOUT_MANAGER"] == addresses["rollout-manager"]
        assert trainer_port == int(next(e["value"] for e in head["env"] if e["name"] == "OVERWORLD_PORT"))
        (tmp_path / "trainer-tmp").mkdir()
        start("trainer", [shutil_which(argv[0]), *argv[1:]], trainer_env)

        deadline = time.monotonic() + TRAINING_TIMEOUT
        version = 0
        while time.monotonic() < deadline:
            for name, proc, _ in processes:
                assert proc.poll() is None, f"{name} exited early\n{logs()}"
            version = latest_version(addresses["model-registry"])
            if version > 1:
                break
            time.sleep(2)
        assert version > 1, f"no updated model version published within {TRAINING_TIMEOUT}s\n{logs()}"
        for component in order:
            healthy(probes[component], timeout=10)
        # The gRPC port itself takes mutual TLS only.
        with grpc.insecure_channel(addresses["model-registry"]) as plaintext, pytest.raises(grpc.RpcError):
            health_status(plaintext, timeout=3)
    finally:
        tls.reset()
        for _, proc, _ in reversed(processes):
            stop_process(proc)
        redis_server.stop()


def shutil_which(command: str) -> str:
    """The container's command from this environment's scripts (the image's PATH)."""
    import shutil
    import sysconfig

    found = shutil.which(
        command, path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    )
    assert found, f"{command} is not installed in this environment"
    return found if command != "python" else sys.executable
