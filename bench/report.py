"""Every benchmark result side by side: bench/results/*.json -> bench/results/REPORT.md (and stdout)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "curve":
                flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif not isinstance(value, list):
        out[prefix] = value


def main() -> None:
    lines = ["# Benchmark results", ""]
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        flat: dict[str, object] = {}
        flatten("", data, flat)
        lines += [f"## {path.stem}", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in flat.items()]
        lines.append("")
    text = "\n".join(lines)
    (RESULTS / "REPORT.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
