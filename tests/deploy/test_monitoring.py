"""Alerts and dashboards: the rendered PrometheusRule passes `promtool check rules` and a
promtool unit test per alert (firing and quiet cases); every dashboard query parses; every
Overworld metric they use is one docs/architecture.md promises."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_support import ARCHITECTURE, CHART, by_kind, promtool, render, values_from_files

RELEASE = "overworld"
SEL = f'overworld_release="{RELEASE}", namespace="rl"'
ALERTS = (
    "OverworldWorkersDown",
    "OverworldPolicyLagHigh",
    "OverworldLearnerStalled",
    "OverworldBufferStarving",
)


def rendered_rule_groups() -> dict[str, Any]:
    objects = render(values_from_files([CHART / "ci" / "monitoring-values.yaml"]), release=RELEASE)
    (rule,) = by_kind(objects, "PrometheusRule").values()
    groups: dict[str, Any] = rule["spec"]
    return groups


def run_promtool(*args: str, cwd: Path) -> str:
    result = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    groups = rendered_rule_groups()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    out = run_promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert "SUCCESS: 4 rules found" in out
    assert [r["alert"] for r in groups["groups"][0]["rules"]] == list(ALERTS)



def test_each_alerts_for_is_its_default_or_the_values_pending_for() -> None:
    """`metrics.prometheusRule.pendingFor` sets each alert's `for:` (the cluster rehearsal makes two
    alerts fire in seconds with it); unset, the defaults the docs' alert table gives."""
    def pending(values: dict[str, Any]) -> dict[str, str]:
        (rule,) = by_kind(render(values, release=RELEASE), "PrometheusRule").values()
        return {r["alert"]: r["for"] for r in rule["spec"]["groups"][0]["rules"]}

    base = values_from_files([CHART / "ci" / "monitoring-values.yaml"])
    assert pending(base) == dict(zip(ALERTS, ("5m", "15m", "10m", "10m"), strict=True))
    base["metrics"]["prometheusRule"]["pendingFor"] = {"workersDown": "10s", "learnerStalled": "30s"}
    assert pending(base) == dict(zip(ALERTS, ("10s", "15m", "30s", "10m"), strict=True))
    base["metrics"]["prometheusRule"]["pendingFor"] = {"workersDown": "soon"}
    with pytest.raises(Exception, match="workersDown"):  # the schema refuses what is not a duration
        pending(base)

def histogram(name: str, lag_buckets: dict[str, str]) -> list[dict[str, str]]:
    return [
        {"series": f'{name}_bucket{{{SEL}, le="{le}"}}', "values": values}
        for le, values in lag_buckets.items()
    ]


# Each case: the alert, input series (1m apart), and at what time it must / must not fire.
# Extra labels of the firing alert come from the rule (severity, and the CI values' team=rl).
CASES: list[dict[str, Any]] = [
    {
        "name": "workers down after five minutes below the minimum",
        "alert": "OverworldWorkersDown",
        "series": [{"series": f"overworld_rollout_workers{{{SEL}}}", "values": "3x10 0x20"}],
        "quiet_at": ["10m", "14m"],
        "fires_at": {"20m": {"severity": "critical"}},
    },
    {
        "name": "workers down when the rollout-manager exports nothing",
        "alert": "OverworldWorkersDown",
        "series": [
            {"series": 'overworld_rollout_workers{overworld_release="someone-else"}', "values": "4x20"}
        ],
        "quiet_at": ["2m"],
        "fires_at": {"10m": {"severity": "critical", "overworld_release": RELEASE}},
    },
    {
        "name": "another release's empty fleet does not page us",
        "alert": "OverworldWorkersDown",
        "series": [
            {"series": f"overworld_rollout_workers{{{SEL}}}", "values": "2x30"},
            {"series": 'overworld_rollout_workers{overworld_release="someone-else"}', "values": "0x30"},
        ],
        "quiet_at": ["10m", "30m"],
        "fires_at": {},
    },
    {
        "name": "policy lag high: p90 above four versions for fifteen minutes",
        "alert": "OverworldPolicyLagHigh",
        # 10 fragments/min, all lagging 6-8 versions.
        "series": histogram(
            "overworld_fragment_policy_lag",
            {"1": "0x40", "2": "0x40", "4": "0x40", "8": "0+10x40", "16": "0+10x40", "+Inf": "0+10x40"},
        ),
        "quiet_at": ["15m"],
        "fires_at": {"35m": {"severity": "warning"}},
    },
    {
        "name": "policy lag fine: fragments one version behind",
        "alert": "OverworldPolicyLagHigh",
        "series": histogram(
            "overworld_fragment_policy_lag",
            {
                "1": "0+10x40",
                "2": "0+10x40",
                "4": "0+10x40",
                "8": "0+10x40",
                "16": "0+10x40",
                "+Inf": "0+10x40",
            },
        ),
        "quiet_at": ["35m"],
        "fires_at": {},
    },
    {
        "name": "learner stalled: the last update is older than fifteen minutes",
        "alert": "OverworldLearnerStalled",
        # The attempt started at t=0, the last update happened at t=60s and never again.
        "series": [
            {"series": f"overworld_training_run_active_since_timestamp_seconds{{{SEL}}}", "values": "0x60"},
            {"series": f"overworld_trainer_last_update_timestamp_seconds{{{SEL}}}", "values": "60x60"},
        ],
        "quiet_at": ["10m", "20m"],
        "fires_at": {"30m": {"severity": "critical"}},
    },
    {
        "name": "learner stalled before its first report",
        "alert": "OverworldLearnerStalled",
        "series": [
            {"series": f"overworld_training_run_active_since_timestamp_seconds{{{SEL}}}", "values": "0x60"},
            {"series": f"overworld_trainer_last_update_timestamp_seconds{{{SEL}}}", "values": "0x60"},
        ],
        "quiet_at": ["20m"],
        "fires_at": {"30m": {"severity": "critical"}},
    },
    {
        "name": "learner quiet before the first progress report (Ray, data, first batch)",
        "alert": "OverworldLearnerStalled",
        # The trainer exports 0 until rank 0 reports; the first report comes after 12 minutes.
        "series": [
            {"series": f"overworld_training_run_active_since_timestamp_seconds{{{SEL}}}", "values": "0x60"},
            {"series": f"overworld_trainer_last_update_timestamp_seconds{{{SEL}}}",
             "values": "0x11 720+60x48"},
        ],
        "quiet_at": ["5m", "11m", "20m", "40m"],
        "fires_at": {},
    },
    {
        "name": "learner quiet after the run succeeded",
        "alert": "OverworldLearnerStalled",
        # Updates until 10m; then the run succeeds: the controller stops exporting the attempt and
        # the trainer's pods go away.
        "series": [
            {"series": f"overworld_training_run_active_since_timestamp_seconds{{{SEL}}}", "values": "0x10 _x50"},
            {"series": f"overworld_trainer_last_update_timestamp_seconds{{{SEL}}}", "values": "0+60x10 _x50"},
        ],
        "quiet_at": ["20m", "40m", "60m"],
        "fires_at": {},
    },
    {
        "name": "learner quiet while no TrainingRun is active (disabled, stopped, not created)",
        "alert": "OverworldLearnerStalled",
        "series": [{"series": f"overworld_rollout_workers{{{SEL}}}", "values": "2x60"}],
        "quiet_at": ["20m", "60m"],
        "fires_at": {},
    },
    {
        "name": "learner healthy: an update every minute",
        "alert": "OverworldLearnerStalled",
        "series": [
            {"series": f"overworld_training_run_active_since_timestamp_seconds{{{SEL}}}", "values": "0x60"},
            {"series": f"overworld_trainer_last_update_timestamp_seconds{{{SEL}}}", "values": "0+60x60"},
        ],
        "quiet_at": ["30m", "60m"],
        "fires_at": {},
    },
    {
        "name": "buffer starving: inserts stop",
        "alert": "OverworldBufferStarving",
        "series": [
            {"series": f"overworld_replay_buffer_inserts_total{{{SEL}}}", "values": "0+100x10 1000x40"},
            *histogram("overworld_replay_buffer_sample_wait_seconds", {"1": "0+5x50", "+Inf": "0+5x50"}),
        ],
        "quiet_at": ["10m"],
        "fires_at": {"35m": {"severity": "warning"}},
    },
    {
        "name": "buffer starving: samplers wait",
        "alert": "OverworldBufferStarving",
        "series": [
            {"series": f"overworld_replay_buffer_inserts_total{{{SEL}}}", "values": "0+100x50"},
            *histogram(
                "overworld_replay_buffer_sample_wait_seconds",
                {"1": "0x50", "5": "0x50", "10": "0+5x50", "+Inf": "0+5x50"},
            ),
        ],
        "quiet_at": ["5m"],
        "fires_at": {"30m": {"severity": "warning"}},
    },
    {
        "name": "buffer healthy",
        "alert": "OverworldBufferStarving",
        "series": [
            {"series": f"overworld_replay_buffer_inserts_total{{{SEL}}}", "values": "0+100x50"},
            *histogram("overworld_replay_buffer_sample_wait_seconds", {"0.1": "0+5x50", "+Inf": "0+5x50"}),
        ],
        "quiet_at": ["30m", "45m"],
        "fires_at": {},
    },
]


def test_every_alert_has_firing_and_quiet_cases() -> None:
    for alert in ALERTS:
        assert any(c["alert"] == alert and c["fires_at"] for c in CASES), f"{alert} never fires in a test"
        assert any(c["alert"] == alert and c["quiet_at"] for c in CASES), f"{alert} has no quiet case"


def test_alert_rules_unit_tests(tmp_path: Path) -> None:
    groups = rendered_rule_groups()
    rules = {r["alert"]: r for r in groups["groups"][0]["rules"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    tests = []
    for case in CASES:
        rule = rules[case["alert"]]
        alert_rule_test = [
            {"eval_time": t, "alertname": case["alert"], "exp_alerts": []} for t in case["quiet_at"]
        ]
        for at, labels in case["fires_at"].items():
            expected_labels = {**labels, "team": "rl"}  # alertLabels of the monitoring CI values
            alert_rule_test.append(
                {
                    "eval_time": at,
                    "alertname": case["alert"],
                    "exp_alerts": [{"exp_labels": expected_labels, "exp_annotations": rule["annotations"]}],
                }
            )
        tests.append(
            {
                "name": case["name"],
                "interval": "1m",
                "input_series": case["series"],
                "alert_rule_test": alert_rule_test,
            }
        )
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    out = run_promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert "SUCCESS" in out


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """Guard against a vacuous harness: expecting a quiet alert to fire must fail."""
    groups = rendered_rule_groups()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    test = {
        "name": "wrong on purpose",
        "interval": "1m",
        "input_series": [{"series": f"overworld_rollout_workers{{{SEL}}}", "values": "5x30"}],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "OverworldWorkersDown",
                "exp_alerts": [{"exp_labels": {"severity": "critical"}}],
            }
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": [test]}))
    result = subprocess.run(
        [promtool(), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode != 0


# --- dashboards ------------------------------------------------------------------------------------

DASHBOARDS = sorted((CHART / "files" / "dashboards").glob("*.json"))


def substitute(expr: str) -> str:
    """Grafana's variables, as Grafana would fill them in before sending the query."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("${datasource}", "prometheus")
        .replace("$namespace", "rl")
        .replace("$release", RELEASE)
    )


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    dashboard = json.loads(path.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((f"{panel['title']} {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *([a-zA-Z_]+)\)", variable["query"]["query"])
            assert match, variable["query"]
            queries.append((f"variable {variable['name']}", match[1]))
    return queries


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_dashboard_queries_parse(dashboard: Path, tmp_path: Path) -> None:
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 10
    rules = [
        {"record": f"dashboard:query_{i}:check", "expr": substitute(expr)}
        for i, (_, expr) in enumerate(queries)
    ]
    (tmp_path / "queries.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": dashboard.stem, "rules": rules}]})
    )
    out = run_promtool("check", "rules", "queries.yaml", cwd=tmp_path)
    assert f"SUCCESS: {len(rules)} rules found" in out


def test_dashboard_query_check_catches_errors(tmp_path: Path) -> None:
    rules = [
        {
            "record": "dashboard:broken:check",
            "expr": substitute("sum(rate(overworld_env_steps_total[$__rate_interval])"),
        }
    ]
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "broken", "rules": rules}]}))
    result = subprocess.run(
        [promtool(), "check", "rules", "queries.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode != 0


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `(overworld_[a-z_]+)` \|", ARCHITECTURE.read_text(), flags=re.M))


def used_metrics(text: str) -> set[str]:
    names = set(re.findall(r"\b(overworld_[a-z_]+)\b", text))
    names -= {"overworld_release"}  # the label the monitors add
    return {
        re.sub(r"_(bucket|sum|count)$", "", n) if n.endswith(("_bucket", "_sum", "_count")) else n
        for n in names
    }


def test_dashboards_and_alerts_use_documented_metrics() -> None:
    documented = documented_metrics()
    assert len(documented) > 30, "could not read the metrics table of docs/architecture.md"
    texts = [p.read_text() for p in DASHBOARDS] + [yaml.safe_dump(rendered_rule_groups())]
    for text in texts:
        unknown = used_metrics(text) - documented
        assert not unknown, f"metrics not in docs/architecture.md: {sorted(unknown)}"
    training = (CHART / "files" / "dashboards" / "overworld-training.json").read_text()
    assert "DCGM_FI_DEV_GPU_UTIL" in training


def test_dashboards_are_well_formed() -> None:
    uids = set()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] not in uids
        uids.add(dashboard["uid"])
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in dashboard["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
            if panel["type"] != "row":
                assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        assert variables == {"datasource", "namespace", "release"}


# Gauges every replay-buffer replica reads from the shared Redis index: each replica reports the
# buffer's whole size, so summing them over replicas multiplies it.
GLOBAL_BUFFER_GAUGES = (
    "overworld_replay_buffer_fragments",
    "overworld_replay_buffer_bytes",
    "overworld_replay_buffer_capacity_fragments",
)


def test_buffer_size_panels_do_not_add_up_replicas() -> None:
    for path in DASHBOARDS:
        for where, expr in dashboard_queries(path):
            for gauge in GLOBAL_BUFFER_GAUGES:
                for match in re.finditer(rf"(\w+)\s*(?:by \([^)]*\))?\s*\(\s*{gauge}\{{", expr):
                    assert match[1] in ("max", "min", "avg"), f"{path.name} {where}: {match[1]}({gauge})"
