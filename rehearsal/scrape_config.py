"""Prometheus' scrape configuration for the rehearsal, made from the rendered chart as a cluster's
prometheus-operator makes it (pkg/prometheus/promcfg.go: generateServiceMonitorConfig,
generatePodMonitorConfig), and the targets Kubernetes' service discovery would hand it.

Each endpoint of a ServiceMonitor or PodMonitor becomes a scrape job (`serviceMonitor/<ns>/<name>/<i>`)
with the operator's relabelling: the monitor's selector as keep/drop rules on the discovered labels,
the endpoint's port, the `namespace`, `service`, `pod`, `container`, `job` and `endpoint` labels, then
the monitor's own relabelings; its interval, timeout, path, scheme and TLS settings (certificates
from the Secrets or ConfigMaps they name). A monitor field this module does not translate is refused,
not skipped.

Discovery is Kubernetes' (`endpoints` role for a ServiceMonitor, `pod` for a PodMonitor) with the same
`__meta_kubernetes_*` labels, served as file_sd target groups that the rehearsal rewrites as pods come
and go (a cluster's Prometheus watches the API server instead).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MONITOR_FIELDS = {"jobLabel", "namespaceSelector", "selector", "endpoints", "podMetricsEndpoints", "targetLabels",
                  "podTargetLabels"}
ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "tlsConfig", "relabelings",
                   "metricRelabelings", "honorLabels", "honorTimestamps"}
TLS_FIELDS = {"ca", "cert", "keySecret", "caFile", "certFile", "keyFile", "serverName", "insecureSkipVerify"}
RELABEL_FIELDS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
                  "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


class UntranslatedMonitor(ValueError):
    """A monitor field the rehearsal does not turn into Prometheus configuration."""


def sanitize(name: str) -> str:
    """A Kubernetes label name as a Prometheus label name (Prometheus' and the operator's rule)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


@dataclass(frozen=True)
class PodView:
    """A pod as the API server (and so Kubernetes service discovery) shows it."""

    name: str
    namespace: str
    ip: str
    labels: dict[str, str]
    ports: dict[str, int]  # container port name -> number
    container: str
    phase: str  # Pending | Running | Succeeded | Failed
    ready: bool


@dataclass
class ScrapeJob:
    """One scrape job and what its service discovery looks at."""

    config: dict[str, Any]
    role: str  # "endpoints" | "pod"
    namespaces: list[str] | None  # None: every namespace
    targets_file: Path


def selector_rules(selector: dict[str, Any], prefix: str, where: str) -> list[dict[str, Any]]:
    """A label selector as the operator's keep/drop relabelings on `<prefix>label_*` (the service's or
    the pod's labels)."""
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise UntranslatedMonitor(f"{where}: selector fields {sorted(unknown)}")
    rules = []
    for key in sorted(selector.get("matchLabels") or {}):
        rules.append({"action": "keep", "source_labels": [f"{prefix}label_{sanitize(key)}",
                                                          f"{prefix}labelpresent_{sanitize(key)}"],
                      "regex": f"({selector['matchLabels'][key]});true"})
    for expression in selector.get("matchExpressions") or []:
        key, operator = sanitize(expression["key"]), expression["operator"]
        if operator not in OPERATORS:
            raise UntranslatedMonitor(f"{where}: selector operator {operator!r} is not one of {', '.join(OPERATORS)}")
        if operator in ("In", "NotIn"):
            rules.append({"action": "keep" if operator == "In" else "drop",
                          "source_labels": [f"{prefix}label_{key}", f"{prefix}labelpresent_{key}"],
                          "regex": f"({'|'.join(expression['values'])});true"})
        else:
            rules.append({"action": "keep" if operator == "Exists" else "drop",
                          "source_labels": [f"{prefix}labelpresent_{key}"], "regex": "true"})
    return rules


def relabelings(items: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    out = []
    for item in items:
        unknown = set(item) - set(RELABEL_FIELDS)
        if unknown:
            raise UntranslatedMonitor(f"{where}: relabeling fields {sorted(unknown)}")
        rule = {RELABEL_FIELDS[k]: v for k, v in item.items()}
        if "action" in rule:
            rule["action"] = str(rule["action"]).lower()
        out.append(rule)
    return out


def tls_config(settings: dict[str, Any], directory: Path, read: Callable[[str, str, str], str],
               where: str) -> dict[str, Any]:
    """An endpoint's tlsConfig as Prometheus' tls_config, the certificates and key it names (in a Secret
    or ConfigMap of the monitor's namespace: `read(kind, name, key)`) written to files."""
    unknown = set(settings) - TLS_FIELDS
    if unknown:
        raise UntranslatedMonitor(f"{where}: tlsConfig fields {sorted(unknown)}")
    out: dict[str, Any] = {}
    if "serverName" in settings:
        out["server_name"] = settings["serverName"]
    if "insecureSkipVerify" in settings:
        out["insecure_skip_verify"] = bool(settings["insecureSkipVerify"])
    for field, key in (("caFile", "ca_file"), ("certFile", "cert_file"), ("keyFile", "key_file")):
        if field in settings:
            out[key] = settings[field]
    sources = {"ca": ("ca_file", settings.get("ca")), "cert": ("cert_file", settings.get("cert")),
               "keySecret": ("key_file", {"secret": settings["keySecret"]} if "keySecret" in settings else None)}
    for field, (key, source) in sources.items():
        if not source:
            continue
        kind = "secret" if "secret" in source else "configMap"
        ref = source[kind]
        path = directory / f"{where.replace('/', '_')}-{field}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(read(kind, ref["name"], ref["key"]))
        path.chmod(0o600)
        out[key] = str(path)
    return out


def scrape_jobs(objects: list[dict[str, Any]], directory: Path,
                read: Callable[[str, str, str], str]) -> list[ScrapeJob]:
    """A scrape job per endpoint of every ServiceMonitor and PodMonitor in the rendered objects."""
    jobs = []
    for monitor in objects:
        if monitor["kind"] not in ("ServiceMonitor", "PodMonitor"):
            continue
        service = monitor["kind"] == "ServiceMonitor"
        meta, spec = monitor["metadata"], monitor["spec"]
        namespace = meta.get("namespace", "default")
        where = f"{monitor['kind']} {namespace}/{meta['name']}"
        unknown = set(spec) - MONITOR_FIELDS
        if unknown:
            raise UntranslatedMonitor(f"{where}: fields {sorted(unknown)}")
        selecting = spec.get("namespaceSelector") or {}
        namespaces = None if selecting.get("any") else list(selecting.get("matchNames") or [namespace])
        prefix = "__meta_kubernetes_service_" if service else "__meta_kubernetes_pod_"
        for index, endpoint in enumerate(spec.get("endpoints" if service else "podMetricsEndpoints") or []):
            unknown = set(endpoint) - ENDPOINT_FIELDS
            if unknown:
                raise UntranslatedMonitor(f"{where} endpoint {index}: fields {sorted(unknown)}")
            name = f"{'serviceMonitor' if service else 'podMonitor'}/{namespace}/{meta['name']}/{index}"
            config: dict[str, Any] = {"job_name": name, "honor_labels": bool(endpoint.get("honorLabels", False))}
            if "honorTimestamps" in endpoint:
                config["honor_timestamps"] = bool(endpoint["honorTimestamps"])
            targets_file = directory / f"{name.replace('/', '_')}.json"
            config["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "5s"}]
            for field, key in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"),
                               ("path", "metrics_path"), ("scheme", "scheme")):
                if field in endpoint:
                    config[key] = endpoint[field]
            if "tlsConfig" in endpoint:
                config["tls_config"] = tls_config(endpoint["tlsConfig"], directory / "tls", read, name)
            rules = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
            if not service:
                rules.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                              "regex": "(Failed|Succeeded)"})
            rules += selector_rules(spec.get("selector") or {}, prefix, where)
            if "port" in endpoint:
                port_label = "__meta_kubernetes_endpoint_port_name" if service else "__meta_kubernetes_pod_container_port_name"
                rules.append({"action": "keep", "source_labels": [port_label], "regex": endpoint["port"]})
            rules += target_label_rules(spec, service, namespace, meta["name"])
            if "port" in endpoint:
                rules.append({"target_label": "endpoint", "replacement": endpoint["port"]})
            rules += relabelings(endpoint.get("relabelings") or [], f"{where} endpoint {index}")
            config["relabel_configs"] = rules
            if endpoint.get("metricRelabelings"):
                config["metric_relabel_configs"] = relabelings(endpoint["metricRelabelings"], f"{where} endpoint {index}")
            jobs.append(ScrapeJob(config, "endpoints" if service else "pod", namespaces, targets_file))
    return jobs


def target_label_rules(spec: dict[str, Any], service: bool, namespace: str, name: str) -> list[dict[str, Any]]:
    """The operator's labels of a target: where it runs, and its job."""
    rules: list[dict[str, Any]] = []
    if service:
        kind_and_name = ["__meta_kubernetes_endpoint_address_target_kind", "__meta_kubernetes_endpoint_address_target_name"]
        rules += [{"source_labels": list(kind_and_name), "separator": ";", "regex": f"{kind};(.*)", "replacement": "${1}",
                   "target_label": kind.lower()} for kind in ("Node", "Pod")]
    rules.append({"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"})
    if service:
        rules.append({"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"})
        rules.append({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"})
        rules.append({"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"})
        rules.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"})
    else:
        rules.append({"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"})
        rules.append({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"})
    for label in spec.get("targetLabels") or []:
        rules.append({"source_labels": [f"__meta_kubernetes_service_label_{sanitize(label)}"],
                      "target_label": sanitize(label), "regex": "(.+)", "replacement": "${1}"})
    for label in spec.get("podTargetLabels") or []:
        rules.append({"source_labels": [f"__meta_kubernetes_pod_label_{sanitize(label)}"],
                      "target_label": sanitize(label), "regex": "(.+)", "replacement": "${1}"})
    if service:
        rules.append({"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"})
    else:
        rules.append({"target_label": "job", "replacement": f"{namespace}/{name}"})
    if spec.get("jobLabel"):
        source = "__meta_kubernetes_service_label_" if service else "__meta_kubernetes_pod_label_"
        rules.append({"source_labels": [source + sanitize(spec["jobLabel"])], "target_label": "job",
                      "regex": "(.+)", "replacement": "${1}"})
    return rules


def _labels(prefix: str, labels: dict[str, str]) -> dict[str, str]:
    out = {}
    for key, value in labels.items():
        out[f"{prefix}label_{sanitize(key)}"] = value
        out[f"{prefix}labelpresent_{sanitize(key)}"] = "true"
    return out


def _pod_labels(pod: PodView) -> dict[str, str]:
    return {"__meta_kubernetes_namespace": pod.namespace, "__meta_kubernetes_pod_name": pod.name,
            "__meta_kubernetes_pod_ip": pod.ip, "__meta_kubernetes_pod_container_name": pod.container,
            "__meta_kubernetes_pod_phase": pod.phase, "__meta_kubernetes_pod_ready": str(pod.ready).lower(),
            **_labels("__meta_kubernetes_pod_", pod.labels)}


def _port_labels(name: str, number: int) -> dict[str, str]:
    return {"__meta_kubernetes_pod_container_port_name": name, "__meta_kubernetes_pod_container_port_number": str(number),
            "__meta_kubernetes_pod_container_port_protocol": "TCP"}


def target_groups(job: ScrapeJob, pods: list[PodView], services: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Kubernetes service discovery finds for a job: one target per container port of each pod
    (`pod` role; a pod without ports, its address alone), or per port of each Service's endpoints, ready
    or not (`endpoints` role), with their `__meta_kubernetes_*` labels."""
    def watched(namespace: str) -> bool:
        return job.namespaces is None or namespace in job.namespaces

    groups = []
    if job.role == "pod":
        for pod in pods:
            if not watched(pod.namespace) or not pod.ip:
                continue
            ports = pod.ports.items() or [("", 0)]
            for name, number in ports:
                address = f"{pod.ip}:{number}" if number else pod.ip
                groups.append({"targets": [address],
                               "labels": {**_pod_labels(pod), **(_port_labels(name, number) if number else {})}})
        return groups
    for service in services:
        meta, spec = service["metadata"], service["spec"]
        namespace = meta.get("namespace", "default")
        selector = spec.get("selector") or {}
        if not watched(namespace) or not selector:
            continue
        backends = [p for p in pods if p.namespace == namespace and p.ip and p.phase == "Running"
                    and all(p.labels.get(k) == v for k, v in selector.items())]
        for port in spec.get("ports") or []:
            target = port.get("targetPort", port["port"])
            for pod in backends:
                endpoint_port = pod.ports.get(target) if isinstance(target, str) else int(target)
                if endpoint_port is None:
                    continue
                port_name = next((n for n, v in pod.ports.items() if v == endpoint_port), "")
                groups.append({"targets": [f"{pod.ip}:{endpoint_port}"], "labels": {
                    **_pod_labels(pod), **(_port_labels(port_name, endpoint_port) if port_name else {}),
                    "__meta_kubernetes_endpoints_name": meta["name"], "__meta_kubernetes_service_name": meta["name"],
                    **_labels("__meta_kubernetes_service_", meta.get("labels") or {}),
                    "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                    "__meta_kubernetes_endpoint_port_protocol": port.get("protocol", "TCP"),
                    "__meta_kubernetes_endpoint_ready": str(pod.ready).lower(),
                    "__meta_kubernetes_endpoint_address_target_kind": "Pod",
                    "__meta_kubernetes_endpoint_address_target_name": pod.name}})
    return groups
