"""Pure construction of the trainer's KubeRay RayJob from a TrainingRun (no I/O)."""

from __future__ import annotations

import copy
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

GROUP = "overworld.dev"
VERSION = "v1alpha1"
PLURAL = "trainingruns"

RAY_GROUP = "ray.io"
RAY_VERSION = "v1"
RAY_PLURAL = "rayjobs"

RUN_LABEL = "overworld.dev/training-run"
ATTEMPT_LABEL = "overworld.dev/attempt"

TRAINER_PORT = 50055
METRICS_PORT = 9090
# KubeRay names the cluster "<rayjob>-<5 chars>" and its head service "<cluster>-head-svc";
# both must stay DNS labels (63 characters).
MAX_RUN_NAME = 40

# The rayproject/ray images run as user "ray" (uid 1000, gid 100); the uid must be numeric
# for runAsNonRoot to be checked by the kubelet.
RAY_UID = 1000
RAY_GID = 100

TLS_MOUNT = "/etc/overworld/tls"


def rayjob_name(run_name: str, attempt: int) -> str:
    """Name of the RayJob of one attempt: ``<run>-a<attempt>``."""
    return f"{run_name[:MAX_RUN_NAME].rstrip('-')}-a{attempt}"


def trainer_entrypoint(resume_from: str = "", extra_args: Sequence[str] = ()) -> str:
    """The RayJob entrypoint: the trainer joining the RayJob's cluster."""
    argv = ["overworld", "serve", "trainer", "--ray-address", "auto"]
    if resume_from:
        argv += ["--resume", resume_from]
    argv += list(extra_args)
    return shlex.join(argv)


def _resources(resources: Mapping[str, Any] | None, gpus: int = 0) -> dict[str, Any]:
    result: dict[str, Any] = copy.deepcopy(dict(resources or {}))
    if gpus:
        limits = dict(result.get("limits") or {})
        limits["nvidia.com/gpu"] = gpus
        result["limits"] = limits
        requests = result.get("requests")
        if requests is not None and "nvidia.com/gpu" in requests:
            requests["nvidia.com/gpu"] = gpus
    return result


def _pod_template(
    spec: Mapping[str, Any],
    group: Mapping[str, Any],
    *,
    container_name: str,
    labels: Mapping[str, str],
    ports: list[dict[str, Any]],
    gpus: int,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": container_name,
        "image": spec["image"],
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        "env": copy.deepcopy(list(spec.get("env") or [])),
        "ports": ports,
        "resources": _resources(group.get("resources"), gpus),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RAY_UID,
            "runAsGroup": RAY_GID,
            "fsGroup": RAY_GID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": [
            # Ray's object store lives in /dev/shm; the container default (64 MiB) is far too small.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if spec.get("tlsSecret"):
        # The trainer's identity on every Ray node: the driver and its Ray Train workers call the
        # services with it (core/tls.py reads OVERWORLD_TLS_DIR).
        container["env"].append({"name": "OVERWORLD_TLS_DIR", "value": TLS_MOUNT})
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        pod_spec["volumes"].append({"name": "tls", "secret": {"secretName": spec["tlsSecret"], "defaultMode": 0o440}})
    if spec.get("serviceAccountName"):
        pod_spec["serviceAccountName"] = spec["serviceAccountName"]
    if spec.get("imagePullSecrets"):
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec["imagePullSecrets"]]
    if group.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(group["nodeSelector"])
    if group.get("tolerations"):
        pod_spec["tolerations"] = copy.deepcopy(list(group["tolerations"]))
    return {"metadata": {"labels": dict(labels)}, "spec": pod_spec}


def _env_port(spec: Mapping[str, Any], name: str, default: int) -> int:
    for item in spec.get("env") or []:
        if item.get("name") == name and str(item.get("value", "")).isdigit():
            return int(item["value"])
    return default


def build_rayjob(training_run: Mapping[str, Any], attempt: int, resume_from: str = "") -> dict[str, Any]:
    """The RayJob for attempt ``attempt`` of ``training_run`` (a TrainingRun body).

    The caller sets the owner reference (``kopf.adopt``) so that deleting the TrainingRun
    deletes its RayJobs.
    """
    meta = training_run["metadata"]
    spec = training_run["spec"]
    run_name: str = meta["name"]
    name = rayjob_name(run_name, attempt)
    labels = {
        **dict(spec.get("podLabels") or {}),
        RUN_LABEL: run_name,
        ATTEMPT_LABEL: str(attempt),
    }
    worker_group = spec.get("workerGroup") or {}
    replicas = int(worker_group.get("replicas", 1))
    gpus = int(worker_group.get("gpus", 1))
    # The trainer driver runs on the head: its gRPC status and its metrics, on the ports its
    # environment gives it (OVERWORLD_PORT, OVERWORLD_METRICS_PORT; 0 turns metrics off).
    trainer_port = _env_port(spec, "OVERWORLD_PORT", TRAINER_PORT)
    metrics_port = _env_port(spec, "OVERWORLD_METRICS_PORT", METRICS_PORT)
    metrics = [{"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"}] if metrics_port else []
    head_ports = [
        {"name": "gcs-server", "containerPort": 6379, "protocol": "TCP"},
        {"name": "dashboard", "containerPort": 8265, "protocol": "TCP"},
        {"name": "client", "containerPort": 10001, "protocol": "TCP"},
        {"name": "trainer", "containerPort": trainer_port, "protocol": "TCP"},
        *metrics,
    ]
    # Ray Train's worker processes report to the driver over gRPC; they serve no metrics.
    worker_ports: list[dict[str, Any]] = []
    cluster_spec: dict[str, Any] = {
        "headGroupSpec": {
            # The head schedules no training work; the GPU workers do.
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
            "template": _pod_template(
                spec,
                spec.get("head") or {},
                container_name="ray-head",
                labels=labels,
                ports=head_ports,
                gpus=0,
            ),
        },
        "workerGroupSpecs": [
            {
                "groupName": "gpu",
                "replicas": replicas,
                "minReplicas": replicas,
                "maxReplicas": replicas,
                "rayStartParams": {},
                "template": _pod_template(
                    spec,
                    worker_group,
                    container_name="ray-worker",
                    labels=labels,
                    ports=worker_ports,
                    gpus=gpus,
                ),
            }
        ],
    }
    if spec.get("rayVersion"):
        cluster_spec["rayVersion"] = spec["rayVersion"]
    if spec.get("rayTokenAuth"):
        # KubeRay (>= 1.5.1) makes a random token Secret, sets RAY_AUTH_MODE/RAY_AUTH_TOKEN in every Ray
        # container and uses the token itself (job submission, status): the Jobs API runs nobody's code.
        cluster_spec["authOptions"] = {"mode": "token"}
    job_spec: dict[str, Any] = {
        "entrypoint": trainer_entrypoint(resume_from, spec.get("trainerArgs") or ()),
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": bool(spec.get("shutdownAfterJobFinishes", True)),
        "rayClusterSpec": cluster_spec,
    }
    if spec.get("ttlSecondsAfterFinished") is not None:
        job_spec["ttlSecondsAfterFinished"] = int(spec["ttlSecondsAfterFinished"])
    return {
        "apiVersion": f"{RAY_GROUP}/{RAY_VERSION}",
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": meta.get("namespace"), "labels": labels},
        "spec": job_spec,
    }


def phase_of(rayjob_status: Mapping[str, Any] | None) -> str:
    """TrainingRun phase from a RayJob's status (jobStatus, jobDeploymentStatus)."""
    status = rayjob_status or {}
    job = str(status.get("jobStatus") or "").upper()
    deployment = str(status.get("jobDeploymentStatus") or "")
    if job == "SUCCEEDED":
        return "Succeeded"
    if job == "FAILED" or deployment in ("Failed", "ValidationFailed"):
        return "Failed"
    if job == "STOPPED" or deployment in ("Suspended", "Suspending"):
        return "Stopped"
    if job == "RUNNING":
        return "Running"
    return "Pending"
