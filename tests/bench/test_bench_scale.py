"""`make scale` in small: the scale rehearsal's harness (bench/bench_scale.py on rehearsal/scale_rehearsal.py)
run end to end with 4 rollout pods, so that it cannot rot between the runs of the full curve (hours of
the whole machine). Every part of a row is measured and every check of the full run holds: the
pipeline while training, a push by relay costing the registry one copy, churn (a quarter of the fleet
deleted mid-push) ending with every worker on the version and the buffer holding exactly what the
workers were told it took, and a soak over every pod, the rollout pods included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_small_scale_run_measures_every_part(tmp_path: Path) -> None:
    results = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_scale", "--sizes", "4", "--modes", "relay", "--window", "20",
         "--pushes", "1", "--soak-minutes", "1", "--workdir", str(tmp_path / "work"), "--results", str(results)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((results / "scale.json").read_text())
    assert not (ROOT / "bench" / "results" / "scale.json").samefile(results / "scale.json")
    (row,) = result["curve"]["relay"]
    assert row["workers"] == 4
    assert row["pipeline"]["env_steps_per_second"] > 0 and row["pipeline"]["fragments_per_second_to_trainer"] > 0
    push = row["push"]
    assert push["push_seconds_median"] > 0 and push["registry_egress_copies"] < 1.5  # one copy by relay
    churn = result["churn"]
    assert churn["push"]["complete"] and churn["survivors_acked"], churn
    assert churn["accounting"]["exact"], churn["accounting"]
    soak = result["soak"]
    assert any("rollout-worker" in key for key in soak["after_warmup"]), sorted(soak["after_warmup"])
    assert soak["largest_drift"] is not None
    assert (results / "scale.png").exists()
