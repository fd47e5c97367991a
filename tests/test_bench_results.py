"""The committed benchmark results say where they come from: the commit they measured, the date, the
machine and the command (bench/runs.py `provenance`), so that every figure in the README and the
report can be traced to the code and the hardware that produced it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_each_result_records_its_provenance(path: Path) -> None:
    data = json.loads(path.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", data.get("commit", "")), f"{path.name}: no commit"
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d", data.get("date", "")), f"{path.name}: no date"
    machine = data.get("machine") or {}
    assert machine.get("cpus") and machine.get("cpu"), f"{path.name}: no machine"
    assert str(data.get("command", "")).startswith("python"), f"{path.name}: no command"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*")), ids=lambda p: p.name)
def test_each_result_is_small_enough_to_read_in_a_diff(path: Path) -> None:
    """Summaries and down-sampled curves in git, not per-episode data."""
    assert path.stat().st_size < 200_000, f"{path.name}: {path.stat().st_size} bytes"


def test_the_readme_figures_are_the_committed_results() -> None:
    """README.md's table of measured figures is what bench/report.py makes of bench/results: a result
    re-run and committed without `python bench/report.py`, or a figure edited by hand, fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_report", RESULTS.parent / "report.py")
    assert spec and spec.loader
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    readme = (RESULTS.parents[1] / "README.md").read_text()
    assert report.readme_block(report.load()) in readme, "README.md's results differ: run python bench/report.py"


def test_the_scaling_model_in_the_docs_is_the_committed_curve() -> None:
    """docs/operations.md's scaling model is bench/scale_model.py's reading of bench/results/scale.json."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_model", RESULTS.parent / "scale_model.py")
    assert spec and spec.loader
    scale_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale_model)
    operations = (RESULTS.parents[1] / "docs" / "operations.md").read_text()
    expected = scale_model.block(json.loads((RESULTS / "scale.json").read_text()))
    assert expected in operations, "docs/operations.md's scaling model differs: run python bench/scale_model.py"
