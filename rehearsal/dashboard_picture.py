"""Draws a dashboard as Grafana lays it out, from the series a real Prometheus returned for each of its
panels during a rehearsal (rehearsal/dashboards.py `capture`, saved by the rehearsal as
output/rehearsal/<dashboard>.json): one plot per panel at its grid position, a legend per series as
the panel's legendFormat names it, a stat panel as its last value.

    python -m rehearsal.dashboard_picture output/rehearsal/overworld-training.json docs/images/overworld-training.png

(`make dashboard-picture` runs exactly that.)
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

GRID_COLUMNS = 24
UNITS = {"percent": "%", "percentunit": "", "s": "s", "bytes": "B", "Bps": "B/s", "short": "", "none": ""}
NOTES = {"GPU use": "rehearsal: a stand-in DCGM exporter, no GPU (0 %)"}


def gapped(points: list[list[float]], start: float, step: float) -> tuple[list[float], list[float]]:
    """(minutes since `start`, values), broken where the series has no point for more than two steps, as
    Grafana leaves a gap instead of drawing a line across it."""
    minutes: list[float] = []
    values: list[float] = []
    for index, (t, v) in enumerate(points):
        if index and t - points[index - 1][0] > 2 * step:
            minutes.append(float("nan"))
            values.append(float("nan"))
        minutes.append((t - start) / 60)
        values.append(v)
    return minutes, values


def draw(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in data["panels"] if p.get("gridPos")]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    row_inches = 0.42
    height_inches = rows * row_inches
    figure = plt.figure(figsize=(18, height_inches))
    top_margin, bottom_margin = 0.3 / height_inches, 0.35 / height_inches  # a title above, ticks below
    start = data["start"]
    for panel in panels:
        grid = panel["gridPos"]
        left, width = grid["x"] / GRID_COLUMNS, grid["w"] / GRID_COLUMNS
        top, height = grid["y"] / rows, grid["h"] / rows
        if panel["type"] == "row":
            figure.text(left + 0.005, 1 - top - height / 2, panel["title"], fontsize=13, fontweight="bold", va="center")
            continue
        axes = figure.add_axes((left + 0.035, 1 - top - height + bottom_margin, width - 0.05,
                                height - top_margin - bottom_margin))
        unit = UNITS.get(panel.get("unit") or "", panel.get("unit") or "")
        axes.set_title(panel["title"] + (f" ({unit})" if unit else ""), fontsize=10, loc="left")
        if not panel["series"]:
            axes.text(0.5, 0.5, "No data", ha="center", va="center", transform=axes.transAxes, color="grey")
        for series in panel["series"]:
            minutes, values = gapped(series["points"], start, data["step"])
            axes.plot(minutes, values, linewidth=1.2, label=series["legend"][:40])
        if panel["type"] == "stat" and panel["series"]:
            last = ", ".join(f"{s['legend']}: {s['points'][-1][1]:g}" for s in panel["series"] if s["points"])
            axes.text(0.02, 0.04, last, transform=axes.transAxes, fontsize=9, va="bottom",
                      bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
        if panel["title"] in NOTES:
            axes.text(0.99, 0.92, NOTES[panel["title"]], transform=axes.transAxes, fontsize=8, ha="right",
                      va="top", color="grey")
        axes.tick_params(labelsize=8)
        axes.grid(alpha=0.3)
        if 0 < len(panel["series"]) <= 8:
            axes.legend(fontsize=7, loc="upper left", framealpha=0.6)
    figure.suptitle(f"{data['title']}, from a cluster rehearsal's Prometheus (x: minutes into the run)",
                    fontsize=14, y=1.0)
    out.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=72, bbox_inches="tight")
    plt.close(figure)
    # a palette of 64 colours: a plot needs no more, and docs/ keeps the file small (~150 KB, not ~600)
    from PIL import Image

    buffer.seek(0)
    Image.open(buffer).convert("RGB").quantize(colors=64).save(out, optimize=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    data_path, out = Path(argv[0]), Path(argv[1])
    if not data_path.exists():
        print(f"error: {data_path} does not exist: run the rehearsal first (make rehearsal), which saves it",
              file=sys.stderr)
        return 1
    draw(json.loads(data_path.read_text()), out)
    print(f"{out} drawn from {data_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
