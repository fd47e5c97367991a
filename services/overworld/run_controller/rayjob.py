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
ROLE_LABEL = "overworld.dev/ray-role"

TRAINER_PORT = 50055
METRICS_PORT = 9090
# KubeRay names the cluster "<rayjob>-<5 chars>" and its head service "<cluster>-head-svc";
# both must stay DNS labels (63 characters).
MAX_RUN_NAME = 40

# The rayproject/ray images run as user "ray" (uid 1000, gid 100); the uid must be numeric
# for runAsNonRoot to be checked by the kubelet.
RAY_UID = 1000
RAY_GID = 100

# A deleted head pod stops the trainer in its preStop hook, through Ray's job API (ray_prestop.py),
# which gives the job RAY_JOB_STOP_WAIT_TIME_S (3 s by default) before SIGKILL; Kubernetes gives the
# pod terminationGracePeriodSeconds (the TrainingRun's, 30 s by default in Kubernetes) in all. The
# trainer reads that grace (OVERWORLD_STOP_GRACE_SECONDS, less the preStop's own seconds) and cuts an
# update short to checkpoint within it; Ray's wait ends just before the kubelet's SIGKILL. Without a
# grace in the TrainingRun, 180 s: past the 120 s a trainer without a deadline waits for its iteration
# (overworld.trainer.driver.STOP_TIMEOUT_SECONDS).
TRAINER_STOP_SECONDS = 120
TERMINATION_GRACE_SECONDS = 180
PRE_STOP_SECONDS = 5  # the preStop's job API call before the trainer's SIGTERM, its `ray stop` after
MIN_GRACE_SECONDS = 15  # the CRD's minimum: a grace shorter than a few seconds checkpoints nothing


def stop_seconds(spec: Mapping[str, Any]) -> tuple[int, int, int]:
    """(the Ray pods' grace period, Ray's stop wait for the trainer job, the trainer's own grace)."""
    grace = max(MIN_GRACE_SECONDS, int(spec.get("terminationGracePeriodSeconds") or TERMINATION_GRACE_SECONDS))
    return grace, grace - PRE_STOP_SECONDS, grace - 2 * PRE_STOP_SECONDS
# KubeRay's retries of one attempt (each on a new RayCluster) when spec.backoffLimit is not set.
DEFAULT_BACKOFF_LIMIT = 2
DASHBOARD_PORT = 8265

RESTRICTED_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}

TLS_MOUNT = "/etc/overworld/tls"


def rayjob_name(run_name: str, attempt: int) -> str:
    """Name of the RayJob of one attempt: ``<run>-a<attempt>``."""
    return f"{run_name[:MAX_RUN_NAME].rstrip('-')}-a{attempt}"


def trainer_entrypoint(resume_from: str = "", extra_args: Sequence[str] = ()) -> str:
    """The RayJob entrypoint: the trainer joining the RayJob's cluster.

    It always resumes: KubeRay runs the same entrypoint again on a new RayCluster for each retry
    (``backoffLimit``), and a retry must continue from the checkpoint the failed try wrote, not
    start over. ``latest`` on a run without a checkpoint starts fresh.

    ``exec``: Ray's job supervisor runs the entrypoint with ``/bin/sh -c`` and, to stop the job, sends
    SIGTERM to the shell and the trainer. The shell dies at once; its orphaned trainer then exits
    as a child of the head's PID 1 (``ray start``), which never reaps it, and Ray waits for that
    zombie until RAY_JOB_STOP_WAIT_TIME_S runs out. With ``exec`` the trainer is the supervisor's own
    child: its exit ends the job."""
    argv = ["overworld", "serve", "trainer", "--ray-address", "auto", "--resume", resume_from or "latest"]
    argv += list(extra_args)
    return "exec " + shlex.join(argv)


def entrypoint_resume(entrypoint: str) -> str:
    """The ``--resume`` value of an entrypoint made by :func:`trainer_entrypoint` ("" if none)."""
    argv = shlex.split(entrypoint)
    return argv[argv.index("--resume") + 1] if "--resume" in argv[:-1] else ""


def with_resume(entrypoint: str, resume_from: str) -> str:
    """The same entrypoint resuming from ``resume_from`` instead."""
    argv = shlex.split(entrypoint)
    argv[argv.index("--resume") + 1] = resume_from
    return "exec " + shlex.join(argv[1:]) if argv[0] == "exec" else shlex.join(argv)


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


# Pod-level scheduling fields a TrainingRun's head and workerGroup may carry, copied as given.
SCHEDULING_FIELDS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                     "priorityClassName", "runtimeClassName")


def _pod_spec(spec: Mapping[str, Any], group: Mapping[str, Any], container: dict[str, Any],
              volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """A restricted pod (Pod Security Standards): numeric non-root user, RuntimeDefault seccomp."""
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RAY_UID,
            "runAsGroup": RAY_GID,
            "fsGroup": RAY_GID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": volumes,
    }
    if spec.get("serviceAccountName"):
        pod_spec["serviceAccountName"] = spec["serviceAccountName"]
    if spec.get("imagePullSecrets"):
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec["imagePullSecrets"]]
    for field in SCHEDULING_FIELDS:
        if group.get(field):
            pod_spec[field] = copy.deepcopy(group[field])
    return pod_spec


def _ray_pod_template(
    spec: Mapping[str, Any],
    group: Mapping[str, Any],
    *,
    container_name: str,
    labels: Mapping[str, str],
    ports: list[dict[str, Any]],
    gpus: int,
    head: bool,
    trainer_port: int,
) -> dict[str, Any]:
    env = copy.deepcopy(list(spec.get("env") or []))
    grace, job_stop_wait, trainer_grace = stop_seconds(spec)
    container: dict[str, Any] = {
        "name": container_name,
        "image": spec["image"],
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        # a trainer that refuses to run (exit 78) logged the user's traceback once: the pod's status shows it
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": env,
        "ports": ports,
        "resources": _resources(group.get("resources"), gpus),
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER_SECURITY),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if head:
        # A deleted head pod (drain, eviction, `kubectl delete`) stops the trainer the way KubeRay
        # stops a deleted RayJob: through Ray's job API, which sends SIGTERM and waits
        # RAY_JOB_STOP_WAIT_TIME_S; the trainer checkpoints and exits. The container's own
        # SIGTERM never reaches the trainer (it goes to `ray start`).
        env.append({"name": "RAY_JOB_STOP_WAIT_TIME_S", "value": str(job_stop_wait)})
        env.append({"name": "OVERWORLD_STOP_GRACE_SECONDS", "value": str(trainer_grace)})
        pre_stop = ["python", "-m", "overworld.run_controller.ray_prestop", "--dashboard",
                    f"http://127.0.0.1:{DASHBOARD_PORT}", "--timeout", str(job_stop_wait), "--stop-ray"]
    else:
        # A deleted worker pod (a spot reclaim, a drain) takes a learner rank with it: its hook asks the
        # trainer to checkpoint within the grace period and end the attempt, for KubeRay's retry to resume.
        pre_stop = ["python", "-m", "overworld.run_controller.ray_prestop", "--trainer-port", str(trainer_port),
                    "--timeout", str(job_stop_wait), "--stop-ray"]
    # `ray start --block` (PID 1) ignores SIGTERM: without stopping Ray here, every Ray pod would
    # take its whole grace period to go, and each resume or retry minutes longer.
    container["lifecycle"] = {"preStop": {"exec": {"command": pre_stop}}}
    volumes: list[dict[str, Any]] = [
        # Ray's object store lives in /dev/shm; the container default (64 MiB) is far too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.get("tlsSecret"):
        # The trainer's identity on every Ray node: the driver and its Ray Train workers call the
        # services with it (core/security/tls.py reads OVERWORLD_TLS_DIR).
        env.append({"name": "OVERWORLD_TLS_DIR", "value": TLS_MOUNT})
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": spec["tlsSecret"], "defaultMode": 0o440}})
    pod_spec = _pod_spec(spec, group, container, volumes)
    pod_spec["terminationGracePeriodSeconds"] = grace
    return {"metadata": {"labels": dict(labels)}, "spec": pod_spec}


def _submitter_pod_template(spec: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    """The pod that runs `ray job submit` (K8sJobMode). KubeRay's default one has the head's image but
    no pull secrets and no security context: a private registry or a namespace enforcing the
    `restricted` Pod Security Standard never gets the job submitted. KubeRay fills in the command
    (`ray job submit ... -- <entrypoint>`) because the container has none."""
    container = {
        "name": "ray-job-submitter",
        "image": spec["image"],
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # The Ray CLI writes to $HOME; the image's home is not ours to write in a restricted pod.
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER_SECURITY),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    head = spec.get("head") or {}
    pod_spec = _pod_spec(spec, head, container, [{"name": "tmp", "emptyDir": {}}])
    pod_spec["restartPolicy"] = "Never"
    pod_spec["automountServiceAccountToken"] = False  # it talks to the Ray head only
    return {"metadata": {"labels": {**labels, ROLE_LABEL: "submitter"}}, "spec": pod_spec}


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
        {"name": "dashboard", "containerPort": DASHBOARD_PORT, "protocol": "TCP"},
        {"name": "client", "containerPort": 10001, "protocol": "TCP"},
        {"name": "trainer", "containerPort": trainer_port, "protocol": "TCP"},
        *metrics,
    ]
    # Ray Train's worker processes report to the driver over gRPC; they serve no metrics.
    worker_ports: list[dict[str, Any]] = []
    cluster_spec: dict[str, Any] = {
        "headGroupSpec": {
            # The head schedules no training work (no CPUs, no GPUs for Ray tasks); the workers do.
            # The trainer driver itself runs there as the job's entrypoint.
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"},
            "template": _ray_pod_template(
                spec, spec.get("head") or {}, container_name="ray-head", labels=labels,
                ports=head_ports, gpus=0, head=True, trainer_port=trainer_port,
            ),
        },
        "workerGroupSpecs": [
            {
                "groupName": "gpu",
                "replicas": replicas,
                "minReplicas": replicas,
                "maxReplicas": replicas,
                "rayStartParams": {},
                "template": _ray_pod_template(
                    spec, worker_group, container_name="ray-worker", labels=labels,
                    ports=worker_ports, gpus=gpus, head=False, trainer_port=trainer_port,
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
    backoff_limit = spec.get("backoffLimit")
    job_spec: dict[str, Any] = {
        "entrypoint": trainer_entrypoint(resume_from, spec.get("trainerArgs") or ()),
        "submissionMode": "K8sJobMode",
        "submitterPodTemplate": _submitter_pod_template(spec, labels),
        "submitterConfig": {"backoffLimit": 2},
        "backoffLimit": DEFAULT_BACKOFF_LIMIT if backoff_limit is None else int(backoff_limit),
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
