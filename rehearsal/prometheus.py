"""A real Prometheus watching the rehearsal as a cluster's Prometheus watches the release: the
machine's `prometheus` server (Debian's package, or the project's pinned copy: rehearsal/server_binaries.py)
on a pod of its own in the `monitoring` namespace, so the chart's NetworkPolicies decide whether it
may scrape; its scrape jobs those the prometheus-operator makes of the rendered ServiceMonitor and
PodMonitor (rehearsal/scrape_config.py), its targets the pods as Kubernetes service discovery finds
them, its rules the rendered PrometheusRule's. The cluster's own exporters that a dashboard needs stand
beside it: a DCGM exporter stand-in (rehearsal/dcgm_standin.py) in `gpu-operator`, scraped with
honor_labels as its own ServiceMonitor does.

    prometheus = Prometheus(cluster, objects, scrape_interval=5.0)
    prometheus.start()
    prometheus.query('sum(rate(overworld_env_steps_total[1m]))')
    prometheus.firing()  # {"OverworldWorkersDown", ...}
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rehearsal.netns import Host, wait_until
from rehearsal.scrape_config import PodView, ScrapeJob, scrape_jobs, target_groups

if TYPE_CHECKING:
    import subprocess

    from rehearsal.cluster import Cluster

MONITORING = "monitoring"  # the namespace Prometheus runs in (kube-prometheus-stack's usual one)
GPU_OPERATOR = "gpu-operator"  # where the DCGM exporter runs
PORT = 9090
DCGM_PORT = 9400
GPU = "nvidia.com/gpu"


class Prometheus:
    def __init__(self, cluster: Cluster, objects: list[dict[str, Any]], scrape_interval: float = 5.0) -> None:
        self.cluster = cluster
        self.objects = objects
        self.scrape_interval = scrape_interval
        self.directory = cluster.workdir / "prometheus"
        self.host: Host | None = None
        self.dcgm_host: Host | None = None
        self.jobs: list[ScrapeJob] = []
        self.started = 0.0  # unix time Prometheus started
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self._discovery: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, binary: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.jobs = scrape_jobs(self.objects, self.directory / "sd", self._read)
        (self.directory / "sd").mkdir(parents=True, exist_ok=True)
        holders = self.directory / "gpu-holders.json"
        self.discover()
        self.dcgm_host = self.cluster.add_outside("dcgm-exporter", GPU_OPERATOR,
                                                  {"app.kubernetes.io/name": "dcgm-exporter"})
        self._procs.append(self.cluster.popen_outside(
            self.dcgm_host, ["python", str(Path(__file__).with_name("dcgm_standin.py")), "--port", str(DCGM_PORT),
                             "--holders", str(holders)], self.directory / "dcgm-exporter.log"))
        (self.directory / "rules.yaml").write_text(yaml.safe_dump(self.rule_groups(), sort_keys=False))
        (self.directory / "prometheus.yml").write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.host = self.cluster.add_outside("prometheus", MONITORING, {"app.kubernetes.io/name": "prometheus"})
        self._procs.append(self.cluster.popen_outside(self.host, [
            binary, f"--config.file={self.directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.directory / 'data'}", f"--web.listen-address=0.0.0.0:{PORT}",
            "--storage.tsdb.retention.time=1d", "--log.level=warn"], self.directory / "prometheus.log"))
        self.started = time.time()
        self._discovery = threading.Thread(target=self._discover_loop, name="prometheus-discovery", daemon=True)
        self._discovery.start()
        try:
            wait_until(lambda: self._get("/-/ready")[0] == 200, 60, "Prometheus ready")
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{self.log()}") from err

    def stop(self) -> None:
        self._stop.set()
        if self._discovery is not None:
            self._discovery.join(timeout=10)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except Exception:  # noqa: BLE001 (a Prometheus that does not stop is killed, whatever went wrong)
                    proc.kill()
                    proc.wait()
        for host in (self.host, self.dcgm_host):
            if host is not None:
                self.cluster.remove_outside(host)
        self.host = self.dcgm_host = None

    def log(self, tail: int = 4000) -> str:
        path = self.directory / "prometheus.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    # --- what it is told -----------------------------------------------------------------------

    def _read(self, kind: str, name: str, key: str) -> str:
        source = self.cluster.secrets if kind == "secret" else self.cluster.config_maps
        return str(source[name][key])

    def rule_groups(self) -> dict[str, Any]:
        groups = [group for obj in self.objects if obj["kind"] == "PrometheusRule" for group in obj["spec"]["groups"]]
        return {"groups": groups}

    def config(self) -> dict[str, Any]:
        interval = f"{self.scrape_interval:g}s"
        dcgm = {"job_name": "dcgm-exporter", "honor_labels": True,
                "static_configs": [{"targets": [f"{self.dcgm_host.address}:{DCGM_PORT}" if self.dcgm_host else ""],
                                    "labels": {"namespace": GPU_OPERATOR}}]}
        return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
                "rule_files": [str(self.directory / "rules.yaml")],
                "scrape_configs": [*(job.config for job in self.jobs), dcgm]}

    # --- service discovery, as the API server would feed it --------------------------------------

    def discover(self) -> None:
        """Rewrite each job's targets file (and the GPU holders the DCGM stand-in reports) from the
        pods there are now; unchanged files are left alone."""
        from rehearsal.pods import NAMESPACE

        with self.cluster.lock:
            pods = [p for p in self.cluster.pods if not p.deleting and p.phase != "Terminated"]
        views = [PodView(p.name, NAMESPACE, p.ip, dict(p.template.labels), dict(p.template.ports),
                         p.template.container, p.phase, p.ready) for p in pods]
        services = [o for o in self.objects if o["kind"] == "Service"]
        for job in self.jobs:
            _write_if_changed(job.targets_file, json.dumps(target_groups(job, views, services), sort_keys=True))
        holders = [{"namespace": NAMESPACE, "pod": p.name, "container": p.template.container} for p in pods
                   if p.phase == "Running" and p.template.extended.get(GPU)]
        _write_if_changed(self.directory / "gpu-holders.json", json.dumps(holders))

    def _discover_loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.discover()
            except Exception as err:  # noqa: BLE001 (keep discovering; a test sees stale targets)
                print(f"rehearsal prometheus discovery error: {err!r}", flush=True)

    # --- the HTTP API ----------------------------------------------------------------------------

    def _get(self, path: str) -> tuple[int, bytes]:
        assert self.host is not None
        return self.cluster.http_get(self.host.address, PORT, path, timeout=30)

    def api(self, endpoint: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        status, body = self._get(f"/api/v1/{endpoint}{'?' + query if query else ''}")
        reply = json.loads(body)
        assert status == 200 and reply.get("status") == "success", f"{endpoint} {params}: {status} {reply}"
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now: its series (metric labels and value)."""
        data = self.api("query", query=expr)
        return list(data["result"]) if data["resultType"] == "vector" else [data]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        return list(data["result"])

    def value(self, expr: str) -> float | None:
        """The value of an instant query with one series (None when it has none)."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])

    def firing(self) -> set[str]:
        return {a["labels"]["alertname"] for a in self.alerts() if a["state"] == "firing"}


def _write_if_changed(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)  # file_sd reads whole files only
