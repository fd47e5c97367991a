"""The chart and every kustomize overlay point the trainer's save_path at the object store
(OVERWORLD_SAVE_PATH, the same s3:// location as the services' OVERWORLD_BLOBS), on the RayJob's head
and on every Ray worker: checkpoints and TensorBoard/W&B files never live on a pod's emptyDir."""

from __future__ import annotations

from typing import Any

import pytest

from overworld.run_controller.rayjob import build_rayjob
from tests.deploy.deploy_support import by_kind, render
from tests.deploy.test_kustomize import OVERLAYS, built  # noqa: F401 (the tree as a user builds it, secrets made)


def assert_trainer_saves_to_the_object_store(objects: list[dict[str, Any]]) -> None:
    (training_run,) = by_kind(objects, "TrainingRun").values()
    registry = by_kind(objects, "Deployment")["overworld-model-registry"]["spec"]["template"]["spec"]["containers"][0]
    blobs = next(e["value"] for e in registry["env"] if e["name"] == "OVERWORLD_BLOBS")
    rayjob = build_rayjob(training_run, attempt=1)
    cluster = rayjob["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["OVERWORLD_SAVE_PATH"].startswith("s3://")
        assert env["OVERWORLD_SAVE_PATH"] == blobs
        assert "OVERWORLD_S3_ENDPOINT" in env


@pytest.mark.parametrize("values", [{}, {"objectStore": {"bucket": "lab", "prefix": "rl/runs"}}])
def test_chart_points_save_path_at_the_object_store(values: dict[str, Any]) -> None:
    objects = render(values)
    assert_trainer_saves_to_the_object_store(objects)
    if values:
        (training_run,) = by_kind(objects, "TrainingRun").values()
        assert {"name": "OVERWORLD_SAVE_PATH", "value": "s3://lab/rl/runs"} in training_run["spec"]["env"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_points_save_path_at_the_object_store(overlay: str, built: dict[str, Any]) -> None:  # noqa: F811
    assert_trainer_saves_to_the_object_store(built[overlay])
