"""docs/architecture.md's metrics table is the code's: every Prometheus metric defined under
services/overworld (found in the source, wherever it moves) is in the table with its type and label
names, and the table has no other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPES = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}


def defined() -> dict[str, tuple[str, list[str]]]:
    """metric name -> (type, label names), from every Counter(...)/Gauge(...)/Histogram(...) call."""
    out: dict[str, tuple[str, list[str]]] = {}
    for path in sorted((ROOT / "services" / "overworld").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in TYPES
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith("overworld_")):
                continue
            labels = node.args[2] if len(node.args) > 2 else next(
                (k.value for k in node.keywords if k.arg == "labelnames"), None)
            names = [e.value for e in labels.elts] if isinstance(labels, ast.List | ast.Tuple) else []  # type: ignore[attr-defined]
            name, kind = node.args[0].value, TYPES[node.func.id]
            if kind == "counter" and not name.endswith("_total"):
                name += "_total"
            out[name] = (kind, names)
    return out


def documented() -> dict[str, tuple[str, list[str]]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    out = {}
    for row in text[text.index("## Metrics"):].splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`overworld_"):
            out[cells[0].strip("`")] = (cells[1], re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[2])))
    return out


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    code, docs = defined(), documented()
    assert len(code) > 40, "the source scan found too few metrics"
    assert code.keys() == docs.keys(), (f"undocumented: {sorted(code.keys() - docs.keys())}; "
                                        f"documented, not defined: {sorted(docs.keys() - code.keys())}")
    wrong = {name: (docs[name], code[name]) for name in code if docs[name] != code[name]}
    assert not wrong, f"(documented, defined) differ: {wrong}"
