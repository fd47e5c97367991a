"""The chart's Grafana dashboards as the rehearsal reads them: every query of every panel, with the
dashboard's variables filled in as Grafana fills them, run against the rehearsal's Prometheus over a
time range (query_range, as a time-series panel asks), and kept (`capture`) for the picture in
docs/operations.md (rehearsal/dashboard_picture.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rehearsal.prometheus import Prometheus

DASHBOARDS = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "overworld" / "files" / "dashboards"


@dataclass(frozen=True)
class Query:
    dashboard: str  # the file's name without .json: overworld-training
    panel: str  # its title
    ref: str  # refId
    expr: str
    legend: str

    @property
    def name(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def panels(path: Path) -> list[dict[str, Any]]:
    """The panels that show data (rows and text left out), nested rows' panels included."""
    out = []
    for panel in json.loads(path.read_text())["panels"]:
        out += [p for p in [panel, *(panel.get("panels") or [])] if p.get("targets")]
    return out


def queries(path: Path) -> list[Query]:
    return [Query(path.stem, p["title"], t["refId"], t["expr"], t.get("legendFormat", ""))
            for p in panels(path) for t in p["targets"]]


def rate_interval(scrape_interval: float, step: float) -> str:
    """Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval)."""
    return f"{max(step + scrape_interval, 4 * scrape_interval):g}s"


def resolve(expr: str, variables: dict[str, str]) -> str:
    """A panel's query with Grafana's variables ($name and ${name}) replaced; a variable left
    unknown is an error, not a query Prometheus would refuse or answer with nothing."""
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"no value for ${name} in {expr}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' label."""
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return text or "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def run_range(prometheus: Prometheus, query: Query, variables: dict[str, str], start: float, end: float,
              step: float) -> list[dict[str, Any]]:
    """A panel query over [start, end]: its series (labels, [[t, value], ...])."""
    return prometheus.query_range(resolve(query.expr, variables), start, end, step)


def capture(prometheus: Prometheus, path: Path, variables: dict[str, str], start: float, end: float,
            step: float) -> dict[str, Any]:
    """Every panel of a dashboard with the series each of its queries returned over [start, end]."""
    board = json.loads(path.read_text())
    out: dict[str, Any] = {"title": board.get("title", path.stem), "start": start, "end": end, "step": step,
                           "panels": []}
    for panel in board["panels"]:
        entry = {"title": panel["title"], "type": panel.get("type"), "gridPos": panel.get("gridPos"),
                 "unit": ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit", ""), "series": []}
        for target in panel.get("targets") or []:
            query = Query(path.stem, panel["title"], target["refId"], target["expr"], target.get("legendFormat", ""))
            for series in run_range(prometheus, query, variables, start, end, step):
                entry["series"].append({"legend": legend(query.legend, series["metric"]),
                                        "points": [[float(t), float(v)] for t, v in series["values"]]})
        out["panels"].append(entry)
    return out
