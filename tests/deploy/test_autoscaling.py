"""The rollout fleet's autoscaler (templates/autoscaling.yaml): a KEDA ScaledObject that validates
against KEDA's own CRD, refused where it would fight Helm or has nothing to query, and a metric that the
real promtool evaluates to what the HPA needs: the workers' busy share, above the target when they never
wait for room, below it when they idle."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rehearsal.autoscaler import Behavior, Recommender
from tests.deploy.deploy_support import by_kind, promtool, render, validate_object

ON = {"rolloutWorker": {"autoscaling": {"enabled": True, "prometheusAddress": "http://prometheus.monitoring:9090"}}}
RELEASE = "overworld"


def scaled_object(values: dict[str, Any] = ON) -> dict[str, Any]:
    (found,) = by_kind(render(values), "ScaledObject").values()
    return found


def test_off_by_default() -> None:
    assert not by_kind(render({}), "ScaledObject")


def test_the_scaled_object_validates_against_kedas_crd_and_targets_the_fleet() -> None:
    objects = render({"rolloutWorker": {"autoscaling": {**ON["rolloutWorker"]["autoscaling"], "minReplicas": 2,
                                                        "maxReplicas": 12, "targetBusyShare": 0.8,
                                                        "scaleDownStabilizationSeconds": 120}}})
    (found,) = by_kind(objects, "ScaledObject").values()
    validate_object(found)
    deployment = by_kind(objects, "Deployment")["overworld-rollout-worker"]
    assert "replicas" not in deployment["spec"]  # the HPA owns the size, and helm upgrade leaves it
    spec = found["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "overworld-rollout-worker"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 12)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == {
        "stabilizationWindowSeconds": 120}
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert trigger["metadata"]["threshold"] == "0.8"
    assert "overworld_trainer_sample_wait_seconds_total" not in trigger["metadata"]["query"]
    assert trigger["metadata"]["serverAddress"] == "http://prometheus.monitoring:9090"


def test_a_misspelt_field_fails_the_crd_check() -> None:
    """The check can fail: KEDA's schema, closed, refuses a field it does not define."""
    found = scaled_object()
    found["spec"]["maxReplicas"] = 3  # KEDA's is maxReplicaCount
    with pytest.raises(Exception, match="maxReplicas"):
        validate_object(found)


@pytest.mark.parametrize(("values", "message"), [
    ({"replicaCount": 4}, "replicaCount null"),
    ({"autoscaling": {"prometheusAddress": ""}}, "prometheusAddress"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas is above maxReplicas"),
])
def test_autoscaling_that_cannot_work_is_refused_with_the_reason(values: dict[str, Any], message: str) -> None:
    worker = {**values, "autoscaling": {**ON["rolloutWorker"]["autoscaling"], **values.get("autoscaling", {})}}
    with pytest.raises(Exception, match=message):
        render({"rolloutWorker": worker})


def workers(idle_slot_seconds_per_minute: int, slots: int = 4, count: int = 2) -> list[dict[str, str]]:
    series = []
    for i in range(count):
        labels = f'overworld_release="{RELEASE}",worker="w{i}"'
        series.append({"series": f"overworld_env_room_wait_seconds_total{{{labels}}}",
                       "values": f"0+{idle_slot_seconds_per_minute}x20"})
        series.append({"series": f"overworld_env_slots{{{labels}}}", "values": f"{slots}x20"})
    return series


def learner(wait_seconds_per_minute: int) -> list[dict[str, str]]:
    return [{"series": f'overworld_trainer_sample_wait_seconds_total{{overworld_release="{RELEASE}"}}',
             "values": f"0+{wait_seconds_per_minute}x20"}]


# (name, input series, the metric's value): the HPA's desired replicas are ceil(replicas x value / target)
CASES = [
    ("workers idle half their time for room: halve", workers(120), 0.5),
    ("workers never wait, the learner waits half its time: grow (by value / target)", [*workers(0), *learner(30)],
     1.0),
    ("workers wait a quarter of their time while the learner waits: the learner's wait does not count",
     [*workers(60), *learner(30)], 0.75),
    ("every slot waits", workers(240), 0.0),
    ("nothing scraped yet (a fresh release): the target, nothing moves", [], 0.75),
]


def test_the_metric_grows_the_fleet_when_the_learner_waits_and_shrinks_it_when_workers_idle(tmp_path: Path) -> None:
    query = scaled_object()["spec"]["triggers"][0]["metadata"]["query"]
    rules = {"groups": [{"name": "autoscaler", "rules": [{"record": "fleet_busy_over_learner_busy", "expr": query}]}]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    tests = [{"name": name, "interval": "1m", "input_series": series,
              "promql_expr_test": [{"expr": "fleet_busy_over_learner_busy", "eval_time": "10m",
                                    "exp_samples": [{"labels": "fleet_busy_over_learner_busy", "value": value}]}]}
             for name, series, value in CASES]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    result = subprocess.run([promtool(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # the harness can fail: the same series, another value expected
    tests[1]["promql_expr_test"][0]["exp_samples"][0]["value"] = 2.0
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m",
                                                         "tests": tests}))
    result = subprocess.run([promtool(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0


# --- the HPA's algorithm, as the rehearsal runs it (rehearsal/autoscaler.py) --------------------------

def recommender(target: float = 0.1, up: float = 0.0, down: float = 0.0, low: int = 1, high: int = 100) -> Recommender:
    return Recommender(Behavior(low, high, target, up, down))


def test_behavior_is_read_from_the_rendered_scaled_object() -> None:
    values = {"rolloutWorker": {"autoscaling": {**ON["rolloutWorker"]["autoscaling"], "minReplicas": 2,
                                                "maxReplicas": 9, "targetBusyShare": 0.85,
                                                "scaleUpStabilizationSeconds": 30,
                                                "scaleDownStabilizationSeconds": 240}}}
    assert Behavior.of(scaled_object(values)) == Behavior(2, 9, 0.85, 30.0, 240.0)


def test_the_documented_examples() -> None:
    """Kubernetes' docs: a metric at 200m for a target of 100m doubles the replicas, at 50m halves them;
    within the tolerance of 0.1 nothing changes."""
    assert recommender().desired(2, 0.2, now=0.0) == 4
    assert recommender().desired(4, 0.05, now=0.0) == 2
    assert recommender().desired(4, 0.109, now=0.0) == 4
    assert recommender().desired(4, 0.0911, now=0.0) == 4
    assert recommender().desired(4, 0.089, now=0.0) == 4  # ceil(4 x 0.89) = 4 all the same
    assert recommender().desired(10, 0.089, now=0.0) == 9


def test_scale_up_is_limited_to_double_or_four_pods_per_fifteen_seconds() -> None:
    r = recommender()
    assert r.desired(2, 1.0, now=0.0) == 6  # 20 asked: max(2 x 2, 2 + 4)
    r.scaled(4, now=0.0)
    assert r.desired(6, 1.0, now=5.0) == 6  # within the same period: still from the 2 it began with
    assert r.desired(6, 1.0, now=16.0) == 12  # a new period: max(6 x 2, 6 + 4)


def test_scale_down_waits_out_its_stabilization_window_so_a_dip_does_not_flap() -> None:
    r = recommender(down=300.0)
    assert r.desired(8, 0.1, now=0.0) == 8
    assert r.desired(8, 0.05, now=60.0) == 8  # 4 recommended, but 8 was recommended within the window
    assert r.desired(8, 0.1, now=120.0) == 8
    assert r.desired(8, 0.05, now=301.0) == 8  # the 8 of 120 s is still in the window
    assert r.desired(8, 0.05, now=421.0) == 4  # every recommendation of the last 300 s was 4


def test_min_and_max_bound_it() -> None:
    assert recommender(low=3).desired(4, 0.01, now=0.0) == 3
    assert recommender(high=5).desired(4, 0.5, now=0.0) == 5
