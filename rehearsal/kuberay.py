"""KubeRay's RayJob controller, as much of it as the rehearsal exercises (read from KubeRay 1.7's
`rayjob_controller.go`, `common/job.go` and `common/pod.go`):

- a new RayJob gets KubeRay's finalizer, a RayCluster `<rayjob>-<5 chars>` (head and worker pods
  started with KubeRay's `ray start` command line built from `rayStartParams` and the container's
  resources: `--num-cpus`/`--memory`/`--num-gpus` from its limits and requests, `--block`, the
  worker's `--address`), the head Services `<cluster>-head-svc` and `<rayjob>-head-svc`, and, once
  the cluster is ready, the submitter pod from `submitterPodTemplate` running KubeRay's own
  `ray job submit` command with the entrypoint (a Job: `submitterConfig.backoffLimit` retries);
- the job's status from the head's dashboard (`/api/jobs/<id>`) is copied into the RayJob; a
  failed job with `backoffLimit` retries left is retried on a new RayCluster with a new job id
  and the *current* entrypoint; a finished one shuts its cluster down
  (`shutdownAfterJobFinishes`);
- a RayJob being deleted: the Ray job is stopped (`/api/jobs/<id>/stop`) and the finalizer
  removed at once; the garbage collector deletes the RayCluster's pods (gracefully: preStop,
  SIGTERM, grace period) and, for a foreground deletion, only then lets the RayJob go;
- `rayClusterSpec.authOptions.mode: token` (`raycluster_controller.go` reconcileAuthSecret,
  `common/pod.go` SetContainerTokenAuthEnvVars): a Secret named after the RayCluster with a random
  `auth_token`, and RAY_AUTH_MODE=token plus RAY_AUTH_TOKEN from that Secret in the head's, the
  workers' and the submitter's containers (unless they set them); KubeRay's own dashboard calls
  carry the token (`x-ray-authorization: Bearer`).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import secrets
import shlex
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from rehearsal.cluster import Cluster
from rehearsal.kube_api import FOREGROUND
from rehearsal.pods import DOMAIN, NAMESPACE, Pod, Workload, quantity, random_suffix

FINALIZER = "ray.io/rayjob-finalizer"
RAYJOBS = f"/apis/ray.io/v1/namespaces/{NAMESPACE}/rayjobs"
DASHBOARD_PORT = 8265
GCS_PORT = 6379
AUTH_TOKEN_KEY = "auth_token"


def ray_start_command(params: dict[str, str], resources: dict[str, Any], head: bool, head_address: str) -> str:
    """KubeRay's generated container command for a Ray node."""
    params = dict(params)
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if "num-cpus" not in params and (limits.get("cpu") or requests.get("cpu")):
        params["num-cpus"] = str(int(-(-quantity(limits.get("cpu") or requests["cpu"]) // 1)))
    if "memory" not in params and limits.get("memory"):
        params["memory"] = str(int(quantity(limits["memory"])))
    if "num-gpus" not in params and limits.get("nvidia.com/gpu"):
        params["num-gpus"] = str(int(quantity(limits["nvidia.com/gpu"])))
    if not head:
        params.setdefault("address", head_address)
    params.setdefault("metrics-export-port", "8080")
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", "52365")
    flags = " ".join(f"--{k}" if v == "true" else f"--{k}={v}" for k, v in sorted(params.items()))
    return f"ulimit -n 65536; ray start {'--head ' if head else ''}{flags}"


def submit_command(dashboard_url: str, job_id: str, entrypoint: str) -> str:
    """KubeRay's K8sJobMode submitter command (common/job.go BuildJobSubmitCommand)."""
    address = f"http://{dashboard_url}"
    health = (f"python -c \"import urllib.request; r=urllib.request.urlopen('{address}/api/gcs_healthz', "
              f"timeout=10); exit(0 if b'success' in r.read() else 1)\"")
    return (f"until {health} >/dev/null 2>&1 ; do echo \"Waiting for Ray Dashboard GCS to become healthy at "
            f"{address} ...\" ; sleep 2 ; done ; if ! ray job status --address {address} {job_id} >/dev/null 2>&1 ; "
            f"then ray job submit --address {address} --no-wait --submission-id {job_id} -- {entrypoint.strip()} ; "
            f"fi ; ray job logs --address {address} --follow {job_id}")


@dataclass
class RayJobState:
    name: str
    cluster: str = ""
    job_id: str = ""
    failed: int = 0
    deleted: bool = False
    teardown: list[Any] = field(default_factory=list)
    pods_gone_at: float = 0.0
    token_auth: bool = False
    created_at: float = field(default_factory=time.monotonic)


class KubeRay:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.jobs: dict[str, RayJobState] = {}

    # Everything below runs in the cluster's controller thread (the control namespace).

    def reconcile(self) -> None:
        listed = self.cluster.api("GET", RAYJOBS).get("items") or []
        for job in listed:
            self._reconcile(job)
        names = {job["metadata"]["name"] for job in listed}
        for name, state in list(self.jobs.items()):
            if name not in names and not state.deleted:
                state.deleted = True  # deleted without us (no finalizer yet): collect its pods
                self._delete_cluster(state)
                self.cluster.event("rayjob-gone", name)

    def _patch(self, name: str, body: dict[str, Any], status: bool = False) -> None:
        path = f"{RAYJOBS}/{name}" + ("/status" if status else "")
        self.cluster.api("PATCH", path, body, "application/merge-patch+json")

    def _reconcile(self, job: dict[str, Any]) -> None:
        meta, spec, status = job["metadata"], job["spec"], job.get("status") or {}
        name = meta["name"]
        state = self.jobs.get(name)
        if state is None:
            state = self.jobs[name] = RayJobState(name)
            self.cluster.event("rayjob-seen", name)
        finalizers = list(meta.get("finalizers") or [])
        if meta.get("deletionTimestamp"):
            self._on_delete(job, state, finalizers)
            return
        if FINALIZER not in finalizers:
            self._patch(name, {"metadata": {"finalizers": [*finalizers, FINALIZER]}})
        deployment = status.get("jobDeploymentStatus", "")
        if deployment in ("Complete", "Failed"):
            if spec.get("shutdownAfterJobFinishes") and state.cluster and not state.teardown:
                state.teardown = self._delete_cluster(state)
            return
        if not state.cluster:
            if all(not t.is_alive() for t in state.teardown):
                self._new_cluster(job, state)
            return
        head = self.cluster.pods_of(f"{state.cluster}-head")
        workers = self.cluster.pods_of(f"{state.cluster}-worker-{spec['rayClusterSpec']['workerGroupSpecs'][0]['groupName']}")
        ready = head and head[0].ready and all(w.ready for w in workers)
        submitter = self.cluster.workloads.get(f"{name}-submitter")
        if ready and submitter is None and deployment == "Initializing":
            self._submit(job, state)
            self._patch(name, {"status": {"jobDeploymentStatus": "Running",
                                          "dashboardURL": self._dashboard(state)}}, status=True)
            return
        if deployment != "Running" or not head:
            return
        info = self._job_info(head[0], state)
        job_status = (info or {}).get("status", "")
        submitter_pods = self.cluster.pods_of(f"{name}-submitter", include_ended=True)
        submitter_done = submitter is not None and (
            any(p.phase == "Succeeded" for p in submitter_pods)
            or (submitter.attempts >= submitter.replicas and all(p.phase == "Failed" for p in submitter_pods)))
        update: dict[str, Any] = {}
        if job_status and job_status != status.get("jobStatus"):
            update["jobStatus"] = job_status
        if job_status in ("SUCCEEDED", "FAILED", "STOPPED") and submitter_done:
            update["jobDeploymentStatus"] = "Failed" if job_status == "FAILED" else "Complete"
        elif submitter_done and not job_status:
            update["jobDeploymentStatus"] = "Failed"
        if update.get("jobDeploymentStatus") == "Failed":
            state.failed += 1
            if state.failed <= int(spec.get("backoffLimit") or 0):
                # Retrying: the cluster goes; then a new RayCluster and a new job id, the same (current)
                # entrypoint.
                self.cluster.event("rayjob-retry", name)
                state.teardown = self._delete_cluster(state)
                state.cluster = ""
                update = {"jobDeploymentStatus": "Retrying", "jobStatus": "", "failed": state.failed}
        if update:
            self._patch(name, {"status": update}, status=True)

    def _token_auth(self, state: RayJobState, pod_spec: dict[str, Any]) -> dict[str, Any]:
        """The pod spec with KubeRay's token-auth environment in its first container."""
        pod_spec = copy.deepcopy(pod_spec)
        container = pod_spec["containers"][0]
        env = container.setdefault("env", [])
        names = {item["name"] for item in env}
        if "RAY_AUTH_MODE" not in names:
            env.append({"name": "RAY_AUTH_MODE", "value": "token"})
        if "RAY_AUTH_TOKEN" not in names:
            env.append({"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": state.cluster, "key": AUTH_TOKEN_KEY}}})
        return pod_spec

    def _headers(self, state: RayJobState) -> dict[str, str]:
        token = (self.cluster.secrets.get(state.cluster) or {}).get(AUTH_TOKEN_KEY)
        return {"x-ray-authorization": f"Bearer {token}"} if token else {}

    def _dashboard(self, state: RayJobState) -> str:
        return f"{state.cluster}-head-svc.{DOMAIN}:{DASHBOARD_PORT}"

    def _new_cluster(self, job: dict[str, Any], state: RayJobState) -> None:
        name, spec = job["metadata"]["name"], job["spec"]
        cluster_spec = spec["rayClusterSpec"]
        state.cluster = f"{name}-{random_suffix()}"
        state.job_id = f"{name}-{random_suffix()}"
        state.teardown = []
        head_service = f"{state.cluster}-head-svc"
        head_labels = {"ray.io/cluster": state.cluster, "ray.io/node-type": "head"}
        self.cluster.add_service(head_service, head_labels, headless=False)
        self.cluster.add_service(f"{name}-head-svc", head_labels, headless=False)
        head_address = f"{head_service}.{DOMAIN}:{GCS_PORT}"
        state.token_auth = (cluster_spec.get("authOptions") or {}).get("mode") == "token"
        if state.token_auth:
            token = base64.b64encode(secrets.token_bytes(32)).decode()
            self.cluster.secrets[state.cluster] = {AUTH_TOKEN_KEY: token}
        groups = [("head", cluster_spec["headGroupSpec"], 1, True)]
        groups += [(f"worker-{g['groupName']}", g, int(g.get("replicas", 1)), False)
                   for g in cluster_spec.get("workerGroupSpecs") or []]
        for suffix, group, replicas, head in groups:
            pod_spec = group["template"]["spec"]
            if state.token_auth:
                pod_spec = self._token_auth(state, pod_spec)
            labels = {**(group["template"].get("metadata", {}).get("labels") or {}), "ray.io/cluster": state.cluster,
                      "ray.io/node-type": "head" if head else "worker"}
            template = self.cluster.template_from_pod_spec(pod_spec, labels)
            container = pod_spec["containers"][0]
            template.argv = ["/bin/bash", "-c", "--", ray_start_command(
                group.get("rayStartParams") or {}, container.get("resources") or {}, head, head_address)]
            template.env.update({"RAY_CLUSTER_NAME": state.cluster, "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
                                 "RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}" if head else head_address})
            if not head:  # KubeRay's name of the head Service on worker pods
                template.env["FQ_RAY_IP"] = f"{head_service}.{DOMAIN}"
            if head:
                template.readiness = ("http", DASHBOARD_PORT, "/api/gcs_healthz")
            else:
                template.readiness = ("tcp", 52365, "")  # the node's dashboard agent (raylet up)
            kind = "RayHead" if head else "RayWorkers"
            self.cluster.add_workload(Workload(f"{state.cluster}-{suffix}", kind, template, replicas, owner=name))
        self._patch(name, {"status": {"jobDeploymentStatus": "Initializing", "jobStatus": "",
                                      "rayClusterName": state.cluster, "jobId": state.job_id}}, status=True)
        self.cluster.event("raycluster-created", state.cluster)

    def _submit(self, job: dict[str, Any], state: RayJobState) -> None:
        name, spec = job["metadata"]["name"], job["spec"]
        template_spec = spec["submitterPodTemplate"]
        labels = dict(template_spec.get("metadata", {}).get("labels") or {})
        labels.update({"ray.io/originated-from-cr-name": name, "ray.io/originated-from-crd": "RayJob"})
        pod_spec = self._token_auth(state, template_spec["spec"]) if state.token_auth else template_spec["spec"]
        template = self.cluster.template_from_pod_spec(pod_spec, labels)
        dashboard = self._dashboard(state)
        template.argv = ["/bin/bash", "-ce", "--", submit_command(dashboard, state.job_id, spec["entrypoint"])]
        template.env.update({"PYTHONUNBUFFERED": "1", "RAY_DASHBOARD_ADDRESS": dashboard,
                             "RAY_JOB_SUBMISSION_ID": state.job_id})
        template.restart = "Never"
        template.readiness = None
        backoff = int((spec.get("submitterConfig") or {}).get("backoffLimit", 2))
        self.cluster.add_workload(Workload(f"{name}-submitter", "Submitter", template, backoff + 1, owner=name))
        self.cluster.event("submitted", f"{name} {state.job_id}: {shlex.quote(spec['entrypoint'])}")

    def _job_info(self, head: Pod, state: RayJobState) -> dict[str, Any] | None:
        request = urllib.request.Request(f"http://{head.ip}:{DASHBOARD_PORT}/api/jobs/{state.job_id}",
                                         headers=self._headers(state))
        try:
            with urllib.request.urlopen(request, timeout=3) as r:
                info: dict[str, Any] = json.loads(r.read())
                return info
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def _stop_job(self, state: RayJobState) -> None:
        head = self.cluster.pods_of(f"{state.cluster}-head")
        if not head:
            return
        request = urllib.request.Request(f"http://{head[0].ip}:{DASHBOARD_PORT}/api/jobs/{state.job_id}/stop",
                                         method="POST", data=b"", headers=self._headers(state))
        with contextlib.suppress(OSError, urllib.error.URLError):
            urllib.request.urlopen(request, timeout=5).close()

    def _delete_cluster(self, state: RayJobState) -> list[Any]:
        threads = []
        for workload in [w for w in list(self.cluster.workloads) if w.startswith(f"{state.cluster}-")]:
            threads += self.cluster.remove_workload(workload, graceful=True)
        threads += self.cluster.remove_workload(f"{state.name}-submitter", graceful=True)
        self.cluster.remove_service(f"{state.cluster}-head-svc")
        self.cluster.secrets.pop(state.cluster, None)  # the token Secret, owned by the RayCluster
        return threads

    def _on_delete(self, job: dict[str, Any], state: RayJobState, finalizers: list[str]) -> None:
        name = job["metadata"]["name"]
        if FINALIZER in finalizers:
            if (job.get("status") or {}).get("jobStatus") not in ("SUCCEEDED", "FAILED", "STOPPED"):
                self._stop_job(state)
            finalizers = [f for f in finalizers if f != FINALIZER]
            self._patch(name, {"metadata": {"finalizers": finalizers}})
        # The garbage collector: the RayCluster (and so its pods) and the submitter Job go.
        if not state.deleted:
            state.deleted = True
            state.teardown = self._delete_cluster(state)
            self.cluster.remove_service(f"{name}-head-svc")
        if all(not t.is_alive() for t in state.teardown) and FOREGROUND in finalizers:
            state.pods_gone_at = time.monotonic()
            self._patch(name, {"metadata": {"finalizers": [f for f in finalizers if f != FOREGROUND]}})
            self.cluster.event("rayjob-gone", name)
