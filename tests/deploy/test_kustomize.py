"""The kustomize tree: the base is the chart's render, and every overlay builds with the real
`kubectl kustomize` into objects that validate strictly and are wired together."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from overworld.run_controller.rayjob import build_rayjob
from tests.deploy.deploy_support import (
    KUBE_VERSIONS,
    KUSTOMIZE,
    by_kind,
    containers,
    kubectl,
    validate_object,
)

OVERLAYS = ("dev-cpu", "gpu", "external-storage")
EXTERNAL_SECRETS = {"overworld-s3", "overworld-redis"}  # created by the user (external-storage)


def build(path: Path) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, KUSTOMIZE / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The tree as a user builds it: a copy, with the Secrets' files made by make_secrets.py."""
    tree = tmp_path_factory.mktemp("kustomize") / "kustomize"
    shutil.copytree(KUSTOMIZE, tree, ignore=shutil.ignore_patterns("secrets"))
    load_script("make_secrets").make(tree / "base" / "secrets")
    return {name: build(tree / "overlays" / name) for name in OVERLAYS} | {"base": build(tree / "base")}


def test_no_secret_is_committed_and_the_build_needs_them(tmp_path: Path) -> None:
    tree = tmp_path / "kustomize"
    shutil.copytree(KUSTOMIZE, tree, ignore=shutil.ignore_patterns("secrets"))
    result = subprocess.run([kubectl(), "kustomize", str(tree / "base")], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "secrets/s3.env" in result.stderr, result.stderr
    tracked = subprocess.run(["git", "ls-files", str(KUSTOMIZE)], capture_output=True, text=True, check=True,
                             cwd=KUSTOMIZE).stdout
    assert "secrets/" not in tracked and ".env" not in tracked, tracked


def test_base_is_the_charts_render() -> None:
    for path, content in load_script("render_base").generated_files().items():
        assert path.read_text() == content, f"{path} is stale: run python deploy/kustomize/render_base.py"


@pytest.mark.parametrize("name", [*OVERLAYS, "base"])
def test_overlay_builds_and_validates(name: str, built: dict[str, list[dict[str, Any]]]) -> None:
    objects = built[name]
    ids = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), "duplicate objects"
    for obj in objects:
        for version in KUBE_VERSIONS:
            try:
                validate_object(obj, version)
            except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc}")


@pytest.mark.parametrize("name", [*OVERLAYS, "base"])
def test_overlay_wiring(name: str, built: dict[str, list[dict[str, Any]]]) -> None:
    objects = built[name]
    services = by_kind(objects, "Service")
    secrets = set(by_kind(objects, "Secret"))
    namespaces = {
        o["metadata"].get("namespace") for o in objects if o["kind"] not in ("CustomResourceDefinition",)
    }
    assert len(namespaces) == 1 and None not in namespaces, namespaces
    (namespace,) = namespaces
    (binding,) = by_kind(objects, "RoleBinding").values()
    assert binding["subjects"][0]["namespace"] == namespace
    envs = [container.get("env", []) for obj in objects for container in containers(obj)] + [
        tr["spec"]["env"] for tr in by_kind(objects, "TrainingRun").values()
    ]
    for env in envs:
        for item in env:
            ref = (item.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                assert ref["name"] in secrets | (EXTERNAL_SECRETS if name == "external-storage" else set()), (
                    ref
                )
            if item["name"] in (
                "OVERWORLD_ROLLOUT_MANAGER",
                "OVERWORLD_REPLAY_BUFFER",
                "OVERWORLD_GAE",
                "OVERWORLD_MODEL_REGISTRY",
            ):
                host, port = item["value"].rsplit(":", 1)
                assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], item
            assert not ("value" in item and "valueFrom" in item), item


def test_dev_cpu(built: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    from overworld.core.config import load_config

    objects = built["dev-cpu"]
    assert "nvidia.com/gpu" not in json.dumps([o for o in objects if o["kind"] != "CustomResourceDefinition"])
    deployments = by_kind(objects, "Deployment")
    for name in ("overworld-rollout-worker", "overworld-replay-buffer", "overworld-gae"):
        assert deployments[name]["spec"]["replicas"] == 1
    assert "nodeSelector" not in deployments["overworld-rollout-worker"]["spec"]["template"]["spec"]
    assert set(by_kind(objects, "PodDisruptionBudget")) == {"overworld-rollout-worker"}
    config = tmp_path / "config.yaml"
    config.write_text(by_kind(objects, "ConfigMap")["overworld-run-config"]["data"]["config.yaml"])
    assert load_config(config).train_config.num_gpus_per_worker == 0
    (training_run,) = by_kind(objects, "TrainingRun").values()
    rayjob = build_rayjob(training_run, attempt=1)
    assert "nvidia.com/gpu" not in json.dumps(rayjob)
    assert "nodeSelector" not in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]


def test_gpu(built: dict[str, list[dict[str, Any]]]) -> None:
    objects = built["gpu"]
    deployments = by_kind(objects, "Deployment")
    worker = deployments["overworld-rollout-worker"]
    assert worker["spec"]["replicas"] == 8
    assert containers(worker)[0]["image"] == "ghcr.io/overworld-rl/overworld-rollout-worker:0.1.0"
    assert containers(worker)[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    (training_run,) = by_kind(objects, "TrainingRun").values()
    assert training_run["spec"]["workerGroup"]["replicas"] == 4
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        (monitor,) = by_kind(objects, kind).values()
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["metadata"]["namespace"] == "overworld"


def test_external_storage(built: dict[str, list[dict[str, Any]]]) -> None:
    objects = built["external-storage"]
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"StatefulSet", "Job"}
    assert all(name.startswith("overworld-tls-") for name in by_kind(objects, "Secret"))  # only certificates
    assert "overworld-seaweedfs" not in json.dumps(objects) and "overworld-redis:" not in json.dumps(objects)
    for name in ("overworld-replay-buffer", "overworld-model-registry"):
        env = {e["name"]: e for e in containers(by_kind(objects, "Deployment")[name])[0]["env"]}
        if name == "overworld-replay-buffer":  # the registry's index is its blob store: no Redis
            assert env["OVERWORLD_INDEX"] == {
                "name": "OVERWORLD_INDEX",
                "valueFrom": {"secretKeyRef": {"name": "overworld-redis", "key": "url"}},
            }
        assert env["OVERWORLD_S3_ENDPOINT"]["value"].startswith("https://")
    manager = {e["name"]: e for e in containers(by_kind(objects, "Deployment")["overworld-rollout-manager"])[0]["env"]}
    assert manager["OVERWORLD_INDEX"]["valueFrom"] == {"secretKeyRef": {"name": "overworld-redis", "key": "url"}}
    base_env = [e["name"] for e in next(iter(by_kind(built["base"], "TrainingRun").values()))["spec"]["env"]]
    (training_run,) = by_kind(objects, "TrainingRun").values()
    assert [e["name"] for e in training_run["spec"]["env"]] == base_env
    assert set(by_kind(objects, "NetworkPolicy")) == {
        f"overworld-{c}"
        for c in ("rollout-manager", "replay-buffer", "gae", "model-registry", "rollout-worker", "ray",
                  "ray-dashboard")
    }
    for name in ("overworld-replay-buffer", "overworld-model-registry"):
        env = {e["name"] for e in containers(by_kind(objects, "Deployment")[name])[0]["env"]}
        assert "OVERWORLD_REDIS_PASSWORD" not in env  # the external URL carries it
