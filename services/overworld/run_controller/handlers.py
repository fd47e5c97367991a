"""kopf handlers of the TrainingRun resource.

- create: RayJob ``<run>-a1`` (resuming from ``spec.resumeFrom`` when set), status attempt 1;
- update of ``spec.resumeFrom`` to a non-empty value: RayJob ``<run>-a<N+1>`` with
  ``--resume <value>``, the previous attempt's RayJob deleted, status attempt N+1;
- events of the RayJobs: the current attempt's phase and KubeRay status in the TrainingRun;
- a background loop: the trainer's model version, env steps and latest checkpoint in the TrainingRun.

Importing this module registers the handlers in kopf's default registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
from typing import Any

import aiohttp
import grpc
import kopf
from prometheus_client import Gauge

from overworld.run_controller import progress
from overworld.run_controller.kube import ApiError, KubeApi, Resource
from overworld.run_controller.rayjob import (
    ATTEMPT_LABEL,
    GROUP,
    PLURAL,
    RAY_GROUP,
    RAY_PLURAL,
    RAY_VERSION,
    RUN_LABEL,
    VERSION,
    build_rayjob,
    entrypoint_resume,
    phase_of,
    rayjob_name,
    with_resume,
)

TRAINING_RUNS = Resource(GROUP, VERSION, PLURAL)
RAYJOBS = Resource(RAY_GROUP, RAY_VERSION, RAY_PLURAL)
PROGRESS_INTERVAL = float(os.environ.get("OVERWORLD_PROGRESS_INTERVAL", "30"))
ANNOTATION_PREFIX = "overworld.dev"
ACTIVE_SINCE = Gauge(
    "overworld_training_run_active_since_timestamp_seconds",
    "Start of the current attempt of a TrainingRun that is Pending or Running (absent otherwise)",
    ["training_run"],
)
_exported_active: set[str] = set()

# The namespace the operator serves (None: every namespace); set by operator.main().
NAMESPACE: str | None = None

_api: KubeApi | None = None
_progress_task: asyncio.Task[None] | None = None


def api() -> KubeApi:
    if _api is None:
        raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=5)
    return _api


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations: the CRD's status schema is strict and has no
    # room for kopf's own fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/run-controller"
    settings.posting.level = logging.WARNING
    if NAMESPACE:
        # A namespaced Role cannot list namespaces or CRDs: serve the given namespace as it is.
        settings.scanning.disabled = True
    settings.watching.server_timeout = 300


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's own minimal logins (service account, then kubeconfig); the same credentials
    serve the controller's RayJob calls."""
    global _api
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        _api = KubeApi(info)
    return info


async def _create_rayjob(body: kopf.Body, attempt: int, resume_from: str, logger: kopf.Logger) -> str:
    job = build_rayjob(body, attempt=attempt, resume_from=resume_from)
    kopf.adopt(job, owner=body)  # owner reference: deleting the TrainingRun deletes its RayJobs
    name: str = job["metadata"]["name"]
    try:
        await api().create(RAYJOBS, body.metadata.namespace or "default", job)
        logger.info(f"created RayJob {name} (attempt {attempt}, entrypoint: {job['spec']['entrypoint']})")
    except ApiError as exc:
        if exc.status != 409:  # 409: made by an earlier try of this handler
            raise kopf.TemporaryError(f"cannot create RayJob {name}: {exc}", delay=10) from exc
    return name


@kopf.on.create(GROUP, VERSION, PLURAL)
async def on_create(
    body: kopf.Body, spec: kopf.Spec, patch: kopf.Patch, logger: kopf.Logger, **_: Any
) -> None:
    resume_from = str(spec.get("resumeFrom") or "")
    name = await _create_rayjob(body, 1, resume_from, logger)
    patch.status.update(
        {
            "phase": "Pending",
            "attempt": 1,
            "rayJob": name,
            "resumedFrom": resume_from,
            "jobStatus": "",
            "jobDeploymentStatus": "",
            "message": f"RayJob {name} created",
            "observedGeneration": body.metadata.get("generation", 1),
            "lastTransitionTime": _now(),
            "attemptStartTime": _now(),
        }
    )


async def _delete_rayjob(namespace: str, name: str, logger: kopf.Logger) -> None:
    """Delete a RayJob and return only once it is gone: with foreground propagation the API keeps it
    until its RayCluster and pods are deleted (and KubeRay's finalizer has stopped the Ray job, which
    lets the trainer checkpoint). Until then this raises TemporaryError, and kopf retries."""
    try:
        await api().delete(RAYJOBS, namespace, name, propagation="Foreground")
    except ApiError as exc:
        if exc.status == 404:
            return
        raise kopf.TemporaryError(f"cannot delete RayJob {name}: {exc}", delay=10) from exc
    try:
        await api().get(RAYJOBS, namespace, name)
    except ApiError as exc:
        if exc.status == 404:
            logger.info(f"RayJob {name} deleted")
            return
        raise kopf.TemporaryError(f"cannot read RayJob {name}: {exc}", delay=10) from exc
    raise kopf.TemporaryError(f"waiting for RayJob {name} (and its pods) to be deleted", delay=3)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec.resumeFrom")
async def on_resume(
    body: kopf.Body,
    status: kopf.Status,
    new: Any,
    old: Any,
    patch: kopf.Patch,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    resume_from = str(new or "")
    if not resume_from:
        logger.info("spec.resumeFrom cleared: the next non-empty value starts a new attempt")
        return
    previous = int(status.get("attempt") or 0)
    attempt = previous + 1
    namespace = body.metadata.namespace or "default"
    old_job = str(
        status.get("rayJob") or (rayjob_name(body.metadata.name or "", previous) if previous else "")
    )
    # The previous attempt's trainer must be gone (and have checkpointed) before the next one
    # starts: two trainers of one run would publish versions and checkpoints over each other.
    if old_job and old_job != rayjob_name(body.metadata.name or "", attempt):
        await _delete_rayjob(namespace, old_job, logger)
    name = await _create_rayjob(body, attempt, resume_from, logger)
    patch.status.update(
        {
            "phase": "Pending",
            "attempt": attempt,
            "rayJob": name,
            "resumedFrom": resume_from,
            "jobStatus": "",
            "jobDeploymentStatus": "",
            "message": f"attempt {attempt} resumes from {resume_from} (was {old!r})",
            "observedGeneration": body.metadata.get("generation", 1),
            "lastTransitionTime": _now(),
            "attemptStartTime": _now(),
        }
    )


@kopf.on.event(RAY_GROUP, RAY_VERSION, RAY_PLURAL, labels={RUN_LABEL: kopf.PRESENT})
async def on_rayjob_event(event: kopf.RawEvent, body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """Mirror the current attempt's RayJob status into its TrainingRun."""
    if event.get("type") == "DELETED":
        return
    labels = body.metadata.labels
    run = labels.get(RUN_LABEL)
    attempt = labels.get(ATTEMPT_LABEL)
    namespace = body.metadata.namespace or "default"
    if not run or not attempt:
        return
    try:
        training_run = await api().get(TRAINING_RUNS, namespace, run)
    except ApiError as exc:
        if exc.status == 404:
            return
        raise
    current = training_run.get("status") or {}
    if str(current.get("attempt")) != attempt:
        return  # an older attempt's job, being deleted
    job_status = body.get("status") or {}
    update = {
        "phase": phase_of(job_status),
        "jobStatus": str(job_status.get("jobStatus") or ""),
        "jobDeploymentStatus": str(job_status.get("jobDeploymentStatus") or ""),
    }
    if message := job_status.get("message"):
        update["message"] = str(message)
    if all(current.get(key) == value for key, value in update.items()):
        return
    if update["phase"] != current.get("phase"):
        update["lastTransitionTime"] = _now()
    await api().merge_patch(TRAINING_RUNS, namespace, run, {"status": update}, subresource="status")
    logger.info(f"TrainingRun {run}: attempt {attempt} is {update['phase']}")


async def refresh_progress(training_run: dict[str, Any], logger: logging.Logger) -> None:
    """Copy the trainer's model version, env steps and latest checkpoint into the status."""
    status = training_run.get("status") or {}
    if status.get("phase") not in ("Running", "Pending") or not status.get("rayJob"):
        return
    meta = training_run["metadata"]
    namespace = meta.get("namespace") or "default"
    try:
        job = await api().get(RAYJOBS, namespace, str(status["rayJob"]))
    except ApiError as exc:
        logger.debug(f"no RayJob yet: {exc}")
        return
    cluster = (job.get("status") or {}).get("rayClusterName")
    if not cluster:
        return
    address = progress.trainer_address(cluster, namespace)
    try:
        current = await progress.read_progress(address)
    except grpc.aio.AioRpcError as exc:
        logger.debug(f"trainer at {address} not answering: {exc.code()}")
        return
    update: dict[str, Any] = {"modelVersion": current.model_version, "envSteps": current.env_steps}
    if current.latest_checkpoint:
        update["latestCheckpoint"] = current.latest_checkpoint
        await _retry_from(job, current.latest_checkpoint, logger)
    if any(status.get(key) != value for key, value in update.items()):
        await api().merge_patch(
            TRAINING_RUNS, namespace, meta["name"], {"status": update}, subresource="status"
        )


async def _retry_from(job: dict[str, Any], checkpoint: str, logger: logging.Logger) -> None:
    """Keep KubeRay's retries of an attempt that started from a named checkpoint going forward.

    KubeRay runs the RayJob's entrypoint again for each retry (backoffLimit). An attempt started
    with ``--resume latest`` continues from the newest checkpoint anyway; one started from a named
    checkpoint (a roll-back) would start from it again and lose what it trained since. So once this
    attempt's trainer reports a newer checkpoint, the entrypoint names that one."""
    entrypoint = str((job.get("spec") or {}).get("entrypoint") or "")
    resume = entrypoint_resume(entrypoint)
    if resume in ("", "latest", checkpoint):
        return
    meta = job["metadata"]
    patch = {"spec": {"entrypoint": with_resume(entrypoint, checkpoint)}}
    await api().merge_patch(RAYJOBS, meta.get("namespace") or "default", meta["name"], patch)
    logger.info(f"RayJob {meta['name']}: a retry now resumes from {checkpoint} (was {resume})")


def export_active(runs: list[dict[str, Any]]) -> None:
    """ACTIVE_SINCE for each run that should be training (Pending or Running), none for the others:
    the learner-stall alert counts from the later of this and the trainer's last update."""
    active: set[str] = set()
    for training_run in runs:
        status = training_run.get("status") or {}
        since = status.get("attemptStartTime")
        if status.get("phase") in ("Pending", "Running") and since:
            name = training_run["metadata"]["name"]
            started = datetime.datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
            ACTIVE_SINCE.labels(name).set(started.timestamp())
            active.add(name)
    for name in _exported_active - active:
        ACTIVE_SINCE.remove(name)
    _exported_active.clear()
    _exported_active.update(active)


async def _progress_loop(namespace: str | None) -> None:
    # A plain task rather than a kopf timer: kopf timers put a finalizer on every
    # TrainingRun, which would block its deletion whenever the controller is gone first
    # (helm uninstall removes both at once).
    logger = logging.getLogger("overworld.run_controller.progress")
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL)
        try:
            runs = await api().list(TRAINING_RUNS, namespace)
            export_active(runs)
            for training_run in runs:
                await refresh_progress(training_run, logger)
        except (ApiError, kopf.TemporaryError, OSError, aiohttp.ClientError) as exc:
            logger.warning(f"progress refresh failed: {exc}")


@kopf.on.startup()
async def start_progress(**_: Any) -> None:
    global _progress_task
    _progress_task = asyncio.get_running_loop().create_task(_progress_loop(NAMESPACE))


@kopf.on.cleanup()
async def stop_progress(**_: Any) -> None:
    if _progress_task is not None:
        _progress_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await _progress_task
