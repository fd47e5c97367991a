"""The run-controller: RayJob construction (unit) and the real operator process against an
in-memory Kubernetes API (kmock) driven with the real kubectl, as a user would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from overworld.core.net import free_port
from overworld.run_controller.rayjob import (
    ATTEMPT_LABEL,
    RUN_LABEL,
    build_rayjob,
    phase_of,
    rayjob_name,
    trainer_entrypoint,
)
from overworld.v1 import trainer_pb2, trainer_pb2_grpc
from rehearsal.api_validation import Validator
from rehearsal.kube_api import FOREGROUND, kubernetes_api, write_kubeconfig
from rehearsal.rbac import ADMIN, Authorizer, serving_certificate
from rehearsal.rbac import serve as serve_rbac
from tests.deploy.deploy_support import by_kind, chart_crds, kubectl, pod_templates, render, validate_object

NAMESPACE = "rl"
RUN = "cow-hunt"


def training_run(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "overworld.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": RUN, "namespace": NAMESPACE},
        "spec": {
            "image": "ghcr.io/overworld-rl/overworld-trainer:0.1.0",
            "rayVersion": "2.60.0",
            "resumeFrom": "",
            "trainerArgs": [],
            "podLabels": {
                "app.kubernetes.io/instance": "overworld",
                "app.kubernetes.io/component": "trainer",
            },
            "env": [
                {"name": "OVERWORLD_PORT", "value": "50055"},
                {"name": "OVERWORLD_METRICS_PORT", "value": "9090"},
                {"name": "OVERWORLD_ROLLOUT_MANAGER", "value": "overworld-rollout-manager:50051"},
                {
                    "name": "OVERWORLD_S3_SECRET_KEY",
                    "valueFrom": {"secretKeyRef": {"name": "overworld-s3", "key": "secret-key"}},
                },
            ],
            "workerGroup": {
                "replicas": 2,
                "gpus": 1,
                "resources": {"requests": {"cpu": "8", "memory": "32Gi"}},
                "nodeSelector": {"nvidia.com/gpu.present": "true"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
        },
    }
    body["spec"].update(spec)
    return body


# --- unit: the RayJob a TrainingRun becomes ------------------------------------------------------


def test_entrypoint_carries_resume_and_extra_args() -> None:
    # Every try resumes: KubeRay runs the same entrypoint again for each retry (backoffLimit).
    assert trainer_entrypoint() == "exec overworld serve trainer --ray-address auto --resume latest"
    assert trainer_entrypoint("latest") == "exec overworld serve trainer --ray-address auto --resume latest"
    assert (
        trainer_entrypoint("ckpt 7", ["--log-every", "10"])
        == "exec overworld serve trainer --ray-address auto --resume 'ckpt 7' --log-every 10"
    )


def test_rayjob_is_valid_and_complete() -> None:
    body = training_run(resumeFrom="ckpt-000042", trainerArgs=["--log-every", "10"])
    job = build_rayjob(body, attempt=3, resume_from="ckpt-000042")
    job["metadata"]["ownerReferences"] = [
        {"apiVersion": "overworld.dev/v1alpha1", "kind": "TrainingRun", "name": RUN, "uid": "u-1"}
    ]
    validate_object(job)  # RayJob CRD schema + strict PodTemplateSpec for head and workers
    assert job["metadata"]["name"] == "cow-hunt-a3"
    assert job["metadata"]["labels"][RUN_LABEL] == RUN and job["metadata"]["labels"][ATTEMPT_LABEL] == "3"
    spec = job["spec"]
    assert (
        spec["entrypoint"] == "exec overworld serve trainer --ray-address auto --resume ckpt-000042 --log-every 10"
    )
    assert spec["backoffLimit"] == 2 and spec["submissionMode"] == "K8sJobMode"
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.60.0"
    # The head runs the trainer driver only: Ray schedules no task or actor there.
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    worker_pod = group["template"]["spec"]
    assert worker_pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert worker_pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert worker_pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    for template in (cluster["headGroupSpec"]["template"], group["template"]):
        assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
        container = pod["containers"][0]
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert {e["name"] for e in container["env"]} >= {
            "OVERWORLD_ROLLOUT_MANAGER",
            "OVERWORLD_S3_SECRET_KEY",
        }
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]


def restricted_violations(template: dict[str, Any]) -> list[str]:
    """What the `restricted` Pod Security Standard would refuse in a pod template."""
    pod = template["spec"]
    problems = []
    pod_context = pod.get("securityContext") or {}
    if (pod_context.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        problems.append("pod seccompProfile")
    for container in pod["containers"]:
        context = container.get("securityContext") or {}
        name = container["name"]
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation")
        if "ALL" not in ((context.get("capabilities") or {}).get("drop") or []):
            problems.append(f"{name}: capabilities.drop ALL")
        if not (context.get("runAsNonRoot") or pod_context.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot")
        if context.get("privileged"):
            problems.append(f"{name}: privileged")
    if any("hostPath" in volume for volume in pod.get("volumes") or []):
        problems.append("hostPath volume")
    return problems


def test_every_pod_of_the_rayjob_is_restricted_and_pulls_with_the_secrets() -> None:
    """KubeRay's default submitter pod has no pull secrets and no security context: in a namespace
    enforcing `restricted`, or with a private registry, the job would never be submitted."""
    job = build_rayjob(training_run(imagePullSecrets=["regcred"], serviceAccountName="trainer"), attempt=1)
    templates = dict(pod_templates(job))
    assert set(templates) == {"headGroupSpec", "workerGroupSpecs[gpu]", "submitterPodTemplate"}
    for where, template in templates.items():
        assert restricted_violations(template) == [], where
        assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}], where
        assert template["spec"]["containers"][0]["image"] == job_image(job), where
        assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "overworld", where
        # a trainer that refuses to run (exit 78) shows the user's traceback in the pod's status
        assert template["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError", where
    submitter = templates["submitterPodTemplate"]["spec"]
    assert submitter["restartPolicy"] == "Never"
    assert "command" not in submitter["containers"][0]  # KubeRay fills in `ray job submit ...`
    assert job["spec"]["submitterConfig"] == {"backoffLimit": 2}


def job_image(job: dict[str, Any]) -> str:
    image: str = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    return image


def test_ray_pods_outlast_the_trainers_checkpoint_on_stop() -> None:
    """Deleting a RayJob (resume) or its head pod stops the trainer through Ray's job API; the
    trainer checkpoints within STOP_TIMEOUT_SECONDS, so Ray's stop wait and the pods' grace period
    must be longer (Ray: 3 s, Kubernetes: 30 s by default)."""
    from overworld.run_controller import rayjob
    from overworld.trainer.driver import STOP_TIMEOUT_SECONDS

    assert rayjob.TRAINER_STOP_SECONDS == STOP_TIMEOUT_SECONDS
    job = build_rayjob(training_run(), attempt=1)
    templates = dict(pod_templates(job))
    head = templates["headGroupSpec"]["spec"]
    wait = int(next(e["value"] for e in head["containers"][0]["env"] if e["name"] == "RAY_JOB_STOP_WAIT_TIME_S"))
    assert STOP_TIMEOUT_SECONDS < wait < head["terminationGracePeriodSeconds"]
    assert templates["workerGroupSpecs[gpu]"]["spec"]["terminationGracePeriodSeconds"] > wait
    pre_stop = head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:3] == ["python", "-m", "overworld.run_controller.ray_prestop"]
    assert pre_stop[pre_stop.index("--timeout") + 1] == str(wait)
    # `ray start --block` as PID 1 ignores SIGTERM: each pod's hook ends Ray, or it waits out its grace.
    assert "--stop-ray" in pre_stop
    # a worker pod's hook asks the trainer on the head (port 50055, the env's) to checkpoint within Ray's wait
    worker = templates["workerGroupSpecs[gpu]"]["spec"]["containers"][0]
    assert worker["lifecycle"]["preStop"]["exec"]["command"] == [
        "python", "-m", "overworld.run_controller.ray_prestop", "--trainer-port", "50055", "--timeout", str(wait),
        "--stop-ray"]


@pytest.mark.parametrize("grace", [30, 120])
def test_a_spot_grace_period_reaches_the_trainer_as_its_deadline(grace: int) -> None:
    """A TrainingRun's terminationGracePeriodSeconds (a spot node pool's notice) is the Ray pods' grace;
    the trainer driver on the head reads what is left of it after the preStop's job stop, and checkpoints
    (its stop budget, less its exit) before Ray's stop wait SIGKILLs it, which comes before the kubelet's."""
    from overworld.trainer.driver import EXIT_SECONDS

    templates = dict(pod_templates(build_rayjob(training_run(terminationGracePeriodSeconds=grace), attempt=1)))
    head = templates["headGroupSpec"]["spec"]
    env = {e["name"]: e.get("value") for e in head["containers"][0]["env"]}
    trainer_grace, wait = int(env["OVERWORLD_STOP_GRACE_SECONDS"]), int(env["RAY_JOB_STOP_WAIT_TIME_S"])
    assert head["terminationGracePeriodSeconds"] == grace
    assert templates["workerGroupSpecs[gpu]"]["spec"]["terminationGracePeriodSeconds"] == grace
    assert EXIT_SECONDS < trainer_grace < wait < grace


def test_rayjob_names_fit_kuberay_limits() -> None:
    long_name = "a" * 63
    name = rayjob_name(long_name, 12345)
    assert len(name) <= 47 and name.endswith("-a12345")
    job = build_rayjob({**training_run(), "metadata": {"name": long_name, "namespace": NAMESPACE}}, attempt=1)
    job["metadata"]["ownerReferences"] = [
        {"apiVersion": "overworld.dev/v1alpha1", "kind": "TrainingRun", "name": long_name, "uid": "u"}
    ]
    validate_object(job)


def test_cpu_run_requests_no_gpu() -> None:
    job = build_rayjob(training_run(workerGroup={"replicas": 1, "gpus": 0}), attempt=1)
    assert "nvidia.com/gpu" not in json.dumps(job)


@pytest.mark.parametrize(
    ("status", "phase"),
    [
        ({}, "Pending"),
        ({"jobStatus": "PENDING", "jobDeploymentStatus": "Initializing"}, "Pending"),
        ({"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}, "Running"),
        ({"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}, "Succeeded"),
        ({"jobStatus": "FAILED", "jobDeploymentStatus": "Failed"}, "Failed"),
        ({"jobStatus": "", "jobDeploymentStatus": "Failed"}, "Failed"),
        ({"jobStatus": "STOPPED", "jobDeploymentStatus": "Running"}, "Stopped"),
    ],
)
def test_phase_of_rayjob_status(status: dict[str, str], phase: str) -> None:
    assert phase_of(status) == phase


# --- the operator process against kmock, driven by kubectl ---------------------------------------


class Trainer(trainer_pb2_grpc.TrainerServicer):
    """Stands in for the trainer driver on the Ray head: answers GetStatus with `status`."""

    status: dict[str, Any] = {}

    async def GetStatus(self, request: Any, context: Any) -> trainer_pb2.TrainerStatus:  # noqa: N802
        return trainer_pb2.TrainerStatus(**Trainer.status)


@contextlib.asynccontextmanager
async def fake_trainer() -> AsyncIterator[str]:
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(Trainer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


async def run_kubectl(kubeconfig: Path, *args: str, check: bool = True) -> str:
    process = await asyncio.create_subprocess_exec(
        kubectl(),
        "--kubeconfig",
        str(kubeconfig),
        "--request-timeout=10s",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    if check and process.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({process.returncode}): {err.decode()}")
    return out.decode()


async def eventually(probe: Any, what: str, log: Path, timeout: float = 60.0) -> Any:
    """Poll an async probe until it returns a truthy value; bounded in time."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; controller log:\n{log.read_text()[-6000:]}")
        await asyncio.sleep(0.5)


@pytest.mark.slow
def test_create_and_resume_with_kubectl(tmp_path: Path) -> None:
    """Create a TrainingRun, let KubeRay (played by kubectl) start it, resume it twice. The controller
    calls the API as the chart's ServiceAccount, through RBAC with the chart's Role: every call it
    makes must be one the Role grants (a verb removed from the Role fails this test)."""
    asyncio.run(asyncio.wait_for(create_and_resume(tmp_path), timeout=300))


def test_kubectl_has_a_trainingrun_validated_as_the_api_server_would(tmp_path: Path) -> None:
    """kubectl (validation on, as a user runs it) against the API front with the chart's CRD: a typo
    in a field name is refused with the server's strict-decoding error, a value of the wrong type with
    422 Invalid, on create and on a merge patch; a good TrainingRun is created."""
    asyncio.run(asyncio.wait_for(validate_with_kubectl(tmp_path), timeout=120))


async def validate_with_kubectl(tmp_path: Path) -> None:
    objects = render({}, namespace=NAMESPACE)
    authorizer, stop = Authorizer(objects), threading.Event()
    certificate = serving_certificate(["127.0.0.1"])
    async with kubernetes_api(NAMESPACE) as (_, url):
        port = free_port()
        front = asyncio.create_task(serve_rbac(authorizer, url.rstrip("/"), "127.0.0.1", port, [], stop,
                                               certificate, Validator(chart_crds())))
        try:
            kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"https://127.0.0.1:{port}", NAMESPACE,
                                          token=authorizer.token_for(ADMIN), ca_pem=certificate[0])

            async def create(body: dict[str, Any]) -> tuple[int, str]:
                manifest = tmp_path / "run.yaml"
                manifest.write_text(yaml.safe_dump(body))
                process = await asyncio.create_subprocess_exec(
                    kubectl(), "--kubeconfig", str(kubeconfig), "--request-timeout=10s", "create", "-f", str(manifest),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await asyncio.wait_for(process.communicate(), timeout=30)
                return process.returncode or 0, (out + err).decode()

            typo = training_run()
            typo["spec"]["imagee"] = typo["spec"].pop("image")
            code, said = await create(typo)
            assert code != 0 and 'strict decoding error: unknown field "spec.imagee"' in said, said
            wrong = training_run(backoffLimit="two")
            code, said = await create(wrong)
            assert code != 0 and f'TrainingRun.overworld.dev "{RUN}" is invalid: spec.backoffLimit' in said, said
            code, said = await create(training_run())
            assert code == 0 and f"trainingrun.overworld.dev/{RUN} created" in said, said
            process = await asyncio.create_subprocess_exec(
                kubectl(), "--kubeconfig", str(kubeconfig), "--request-timeout=10s", "patch", "trainingrun", RUN,
                "--type", "merge", "-p", json.dumps({"spec": {"resumeFrom": 3}}),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(process.communicate(), timeout=30)
            assert process.returncode != 0 and "spec.resumeFrom" in err.decode(), (out, err)
            await run_kubectl(kubeconfig, "patch", "trainingrun", RUN, "--type", "merge",
                              "-p", json.dumps({"spec": {"resumeFrom": "latest"}}))
        finally:
            stop.set()
            await front


async def create_and_resume(tmp_path: Path) -> None:
    objects = render({}, namespace=NAMESPACE)
    account = by_kind(objects, "Deployment")["overworld-run-controller"]["spec"]["template"]["spec"]["serviceAccountName"]
    user = f"system:serviceaccount:{NAMESPACE}:{account}"
    authorizer, requests, stop = Authorizer(objects), [], threading.Event()
    certificate = serving_certificate(["127.0.0.1"])
    async with kubernetes_api(NAMESPACE) as (_, url), fake_trainer() as trainer_address:
        port = free_port()
        front = asyncio.create_task(serve_rbac(authorizer, url.rstrip("/"), "127.0.0.1", port, requests, stop,
                                               certificate, Validator(chart_crds())))
        try:
            await drive_controller(f"https://127.0.0.1:{port}", trainer_address, tmp_path, certificate[0],
                                   controller_token=authorizer.token_for(user), admin_token=authorizer.token_for(ADMIN))
        finally:
            stop.set()
            await front
    made = sorted({(r.verb, r.group, r.resource) for r in requests if r.user == user})
    refused = sorted({(r.verb, r.group, r.resource) for r in requests if r.user == user and not authorizer.allowed(r)})
    assert made and not refused, f"the controller was refused {refused}; it called {made}"
    assert ("patch", "ray.io", "rayjobs") in made and ("create", "ray.io", "rayjobs") in made, made


async def drive_controller(url: str, trainer_address: str, tmp_path: Path, ca_pem: bytes, controller_token: str,
                           admin_token: str) -> None:
    Trainer.status = {"state": "running", "model_version": 7, "samples_trained": 123456, "env_steps": 654321,
                      "latest_checkpoint": "ckpt-000007"}
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url, NAMESPACE, token=admin_token, ca_pem=ca_pem)
    controller_kubeconfig = write_kubeconfig(tmp_path / "controller-kubeconfig", url, NAMESPACE,
                                             token=controller_token, ca_pem=ca_pem)
    log = tmp_path / "controller.log"
    env = {
        **os.environ,
        "KUBECONFIG": str(controller_kubeconfig),
        "OVERWORLD_PROGRESS_INTERVAL": "1",
        "OVERWORLD_TRAINER_ADDRESS": trainer_address,
    }
    with log.open("wb") as log_file:
        controller = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "overworld.run_controller",
            "--namespace",
            NAMESPACE,
            "--verbose",
            env=env,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        manifest = tmp_path / "trainingrun.yaml"
        manifest.write_text(yaml.safe_dump(training_run()))
        await run_kubectl(kubeconfig, "create", "-f", str(manifest))

        async def rayjobs() -> dict[str, dict[str, Any]]:
            listed = json.loads(await run_kubectl(kubeconfig, "get", "rayjobs", "-o", "json"))
            return {item["metadata"]["name"]: item for item in listed["items"]}

        async def run_status() -> dict[str, Any]:
            got = json.loads(await run_kubectl(kubeconfig, "get", "trainingrun", RUN, "-o", "json"))
            status: dict[str, Any] = got.get("status") or {}
            return status

        first = (await eventually(rayjobs, "the first RayJob", log))[f"{RUN}-a1"]
        assert first["spec"]["entrypoint"] == "exec overworld serve trainer --ray-address auto --resume latest"
        (owner,) = first["metadata"]["ownerReferences"]
        run_uid = json.loads(await run_kubectl(kubeconfig, "get", "trainingrun", RUN, "-o", "json"))[
            "metadata"
        ]["uid"]
        assert owner["kind"] == "TrainingRun" and owner["name"] == RUN and owner["uid"] == run_uid
        validate_object({k: v for k, v in first.items() if k != "status"})
        await eventually(
            lambda: _matches(run_status, attempt=1, phase="Pending", rayJob=f"{RUN}-a1"),
            "status attempt 1",
            log,
        )

        # KubeRay takes the RayJob (its finalizer stops the Ray job before the RayJob goes) and starts
        # the job: the phase follows, and the trainer's progress appears.
        await run_kubectl(
            kubeconfig, "patch", "rayjob", f"{RUN}-a1", "--type", "merge",
            "-p", json.dumps({"metadata": {"finalizers": [KUBERAY_FINALIZER]}}),
        )
        await run_kubectl(
            kubeconfig,
            "patch",
            "rayjob",
            f"{RUN}-a1",
            "--subresource=status",
            "--type",
            "merge",
            "-p",
            json.dumps(
                {
                    "status": {
                        "jobStatus": "RUNNING",
                        "jobDeploymentStatus": "Running",
                        "rayClusterName": f"{RUN}-a1-x7k2p",
                    }
                }
            ),
        )
        await eventually(
            lambda: _matches(
                run_status,
                phase="Running",
                jobStatus="RUNNING",
                modelVersion=7,
                envSteps=654321,  # the env steps column shows env steps, not samples trained
                latestCheckpoint="ckpt-000007",
            ),
            "phase Running with the trainer's progress",
            log,
        )

        # The user resumes from a checkpoint: a new attempt, the old RayJob gone.
        await run_kubectl(
            kubeconfig,
            "patch",
            "trainingrun",
            RUN,
            "--type",
            "merge",
            "-p",
            '{"spec":{"resumeFrom":"ckpt-000042"}}',
        )
        # Attempt 1 is being deleted; KubeRay's finalizer holds it while its trainer checkpoints.
        # Attempt 2 must not start before attempt 1 is gone: two trainers of one run would overlap.
        await eventually(
            lambda: _deleting(rayjobs, f"{RUN}-a1"), "attempt 1 marked for deletion", log
        )
        # Foreground: the RayJob stays until its RayCluster and pods are gone, not only KubeRay's finalizer.
        assert FOREGROUND in (await rayjobs())[f"{RUN}-a1"]["metadata"]["finalizers"]
        for _ in range(6):
            assert f"{RUN}-a2" not in await rayjobs(), "attempt 2 created while attempt 1 still exists"
            await asyncio.sleep(0.5)
        await run_kubectl(
            kubeconfig, "patch", "rayjob", f"{RUN}-a1", "--type", "merge",
            "-p", json.dumps({"metadata": {"finalizers": None}}),
        )
        jobs = await eventually(
            lambda: _only(rayjobs, {f"{RUN}-a2"}), "RayJob of attempt 2 (and attempt 1 deleted)", log
        )
        second = jobs[f"{RUN}-a2"]
        assert (
            second["spec"]["entrypoint"] == "exec overworld serve trainer --ray-address auto --resume ckpt-000042"
        )
        assert second["spec"]["backoffLimit"] == 2
        assert second["metadata"]["labels"][ATTEMPT_LABEL] == "2"
        await eventually(
            lambda: _matches(
                run_status, attempt=2, phase="Pending", rayJob=f"{RUN}-a2", resumedFrom="ckpt-000042"
            ),
            "status attempt 2",
            log,
        )

        # Attempt 2 runs from ckpt-000042 and writes ckpt-000050: a KubeRay retry of attempt 2 must
        # continue from there, not roll back to ckpt-000042 again.
        Trainer.status = {**Trainer.status, "resumed_from": "ckpt-000042", "latest_checkpoint": "ckpt-000050"}
        await run_kubectl(
            kubeconfig, "patch", "rayjob", f"{RUN}-a2", "--subresource=status", "--type", "merge",
            "-p", json.dumps({"status": {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running",
                                         "rayClusterName": f"{RUN}-a2-b8c1d"}}),
        )
        await eventually(
            lambda: _entrypoint_resumes(rayjobs, f"{RUN}-a2", "ckpt-000050"),
            "attempt 2's retries resuming from its newest checkpoint", log,
        )

        # And "latest" once more: attempt 3.
        await run_kubectl(
            kubeconfig,
            "patch",
            "trainingrun",
            RUN,
            "--type",
            "merge",
            "-p",
            '{"spec":{"resumeFrom":"latest"}}',
        )
        # The garbage collector (played here) removes attempt 2 once its pods are gone.
        await eventually(lambda: _deleting(rayjobs, f"{RUN}-a2"), "attempt 2 marked for deletion", log)
        await run_kubectl(
            kubeconfig, "patch", "rayjob", f"{RUN}-a2", "--type", "merge",
            "-p", json.dumps({"metadata": {"finalizers": None}}),
        )
        jobs = await eventually(lambda: _only(rayjobs, {f"{RUN}-a3"}), "RayJob of attempt 3", log)
        assert jobs[f"{RUN}-a3"]["spec"]["entrypoint"].endswith("--resume latest")
        await eventually(lambda: _matches(run_status, attempt=3), "status attempt 3", log)
        table = await run_kubectl(kubeconfig, "get", "trainingrun", RUN)
        assert RUN in table
    finally:
        if controller.returncode is None:
            controller.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(controller.wait(), timeout=30)
            except TimeoutError:
                controller.kill()
                await controller.wait()
    assert controller.returncode == 0, log.read_text()[-6000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-6000:]


async def _matches(probe: Any, **expected: Any) -> bool:
    status = await probe()
    return all(status.get(key) == value for key, value in expected.items())


KUBERAY_FINALIZER = "ray.io/rayjob-finalizer"


async def _deleting(probe: Any, name: str) -> bool:
    jobs: dict[str, Any] = await probe()
    return name in jobs and bool(jobs[name]["metadata"].get("deletionTimestamp"))


async def _entrypoint_resumes(probe: Any, name: str, checkpoint: str) -> bool:
    jobs: dict[str, Any] = await probe()
    return name in jobs and jobs[name]["spec"]["entrypoint"].endswith(f"--resume {checkpoint}")


async def _only(probe: Any, names: set[str]) -> dict[str, Any] | None:
    jobs: dict[str, Any] = await probe()
    return jobs if set(jobs) == names else None
