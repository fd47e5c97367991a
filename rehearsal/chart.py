"""The chart as the rehearsal reads it: deploy/helm/overworld rendered by real Helm (helm-python-sdk,
which enforces values.schema.json), values files merged as `helm -f A -f B` merges them, and the
chart's own CRDs. The deployment tests use the same functions (tests/deploy/deploy_support.py)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "overworld"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def values_from_files(files: Iterable[Path]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path in files:
        values = deep_merge(values, yaml.safe_load(path.read_text()) or {})
    return values


def render_files(
    values: dict[str, Any] | None = None, *, release: str = "overworld", namespace: str = "rl"
) -> dict[str, str]:
    """Render the chart with real Helm (helm-python-sdk): template path -> text. Enforces values.schema.json."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values or {}, name=release, namespace=namespace, is_install=True)


def parse_manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("__source__", path)
                objects.append(doc)
    return objects


def render(values: dict[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    objects = parse_manifests(render_files(values, **kwargs))
    for obj in objects:
        obj.pop("__source__", None)
    return objects


def chart_crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(path.read_text()) for path in sorted((CHART / "crds").glob("*.yaml"))]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}
