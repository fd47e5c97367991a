"""The rehearsal's Prometheus configuration made from the rendered chart as the prometheus-operator
makes it (rehearsal/scrape_config.py), in seconds: Prometheus' own checker accepts it, each
monitor's selector, port and relabelings are in its job, TLS settings become certificate files, and a
monitor field that is not translated is refused instead of being scraped without it."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rehearsal.scrape_config import UntranslatedMonitor, scrape_jobs
from tests.deploy.deploy_support import CHART, by_kind, promtool, render, values_from_files

NAMESPACE = "rl"


def chart() -> list[dict[str, Any]]:
    return render(values_from_files([CHART / "ci" / "monitoring-values.yaml"]), namespace=NAMESPACE)


def no_secrets(kind: str, name: str, key: str) -> str:
    raise AssertionError(f"the chart's monitors name no {kind} ({name}/{key})")


def test_the_charts_monitors_make_a_configuration_prometheus_accepts(tmp_path: Path) -> None:
    objects = chart()
    jobs = scrape_jobs(objects, tmp_path / "sd", no_secrets)
    assert [job.config["job_name"] for job in jobs] == ["serviceMonitor/rl/overworld/0", "podMonitor/rl/overworld/0"]
    assert [(job.role, job.namespaces) for job in jobs] == [("endpoints", [NAMESPACE]), ("pod", [NAMESPACE])]
    service, pod = (job.config for job in jobs)
    for config, port_label in ((service, "__meta_kubernetes_endpoint_port_name"),
                               (pod, "__meta_kubernetes_pod_container_port_name")):
        rules = config["relabel_configs"]
        assert {"action": "keep", "source_labels": [port_label], "regex": "metrics"} in rules, rules
        assert {"action": "replace", "target_label": "overworld_release", "replacement": "overworld"} in rules
        assert config["metrics_path"] == "/metrics"
    assert service["scrape_interval"] == "30s"  # ci/monitoring-values.yaml
    # the headless Services select the same pods: the operator's drop on the label they carry
    assert {"action": "drop", "source_labels": ["__meta_kubernetes_service_labelpresent_overworld_dev_headless"],
            "regex": "true"} in service["relabel_configs"]
    (rule,) = by_kind(objects, "PrometheusRule").values()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "5s"}, "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [job.config for job in jobs]}))
    checked = subprocess.run([promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                             text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 4 rules found" in checked.stdout, checked.stdout


def service_monitor(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    return monitor


def test_an_endpoints_tls_settings_become_prometheus_tls_with_the_secrets_files(tmp_path: Path) -> None:
    objects = copy.deepcopy(chart())
    service_monitor(objects)["spec"]["endpoints"][0].update(scheme="https", tlsConfig={
        "ca": {"secret": {"name": "metrics-tls", "key": "ca.crt"}},
        "cert": {"configMap": {"name": "metrics-client", "key": "tls.crt"}},
        "keySecret": {"name": "metrics-tls", "key": "tls.key"}, "serverName": "overworld-metrics"})
    stored = {("secret", "metrics-tls", "ca.crt"): "CA", ("configMap", "metrics-client", "tls.crt"): "CERT",
              ("secret", "metrics-tls", "tls.key"): "KEY"}
    (job, _) = scrape_jobs(objects, tmp_path, lambda kind, name, key: stored[kind, name, key])
    tls = job.config["tls_config"]
    assert job.config["scheme"] == "https" and tls["server_name"] == "overworld-metrics"
    assert [Path(tls[k]).read_text() for k in ("ca_file", "cert_file", "key_file")] == ["CA", "CERT", "KEY"]
    assert Path(tls["key_file"]).stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(("change", "says"), [
    (lambda m: m["spec"]["endpoints"][0].update(bearerTokenSecret={"name": "t", "key": "k"}), "bearerTokenSecret"),
    (lambda m: m["spec"].update(sampleLimit=10), "sampleLimit"),
    (lambda m: m["spec"]["endpoints"][0].update(tlsConfig={"ca": {}, "keyFile": "k", "minVersion": "TLS13"}),
     "minVersion"),
    (lambda m: m["spec"]["selector"]["matchExpressions"].append({"key": "a", "operator": "Matches"}), "Matches"),
    (lambda m: m["spec"]["endpoints"][0]["relabelings"].append({"action": "keep", "sourceLabel": "x"}),
     "sourceLabel"),
], ids=["bearer-token", "sample-limit", "tls-min-version", "unknown-operator", "unknown-relabeling-field"])
def test_a_monitor_field_that_is_not_translated_is_refused(tmp_path: Path, change: Any, says: str) -> None:
    objects = copy.deepcopy(chart())
    change(service_monitor(objects))
    with pytest.raises(UntranslatedMonitor, match=says):
        scrape_jobs(objects, tmp_path, no_secrets)
