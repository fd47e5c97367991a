"""What starting Ray costs before the first training step, knob by knob.

Each knob set runs in a fresh process (Ray reads most of them at import): import Ray, `ray.init`,
then a `TorchTrainer` with one worker whose training function only notes the time, as the trainer's
driver does before PPO's first step. The sets are cumulative, from Ray's defaults to what
`overworld.trainer.driver.start_ray` uses, so each row shows one knob's effect. Timings are the
median of BENCH_STARTUP_REPEATS (default 3) runs.

    python -m bench.bench_startup            -> bench/results/startup.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.runs import write

# (name, environment added, ray.init keyword arguments added); cumulative, in this order.
KNOBS: list[tuple[str, dict[str, str], dict[str, Any]]] = [
    ("Ray defaults (dashboard on)", {}, {}),
    ("no dashboard (as before this bench)", {}, {"include_dashboard": False}),
    ("no usage stats", {"RAY_USAGE_STATS_ENABLED": "0"}, {}),
    ("object store 128 MiB", {}, {"object_store_memory": 128 * 2**20}),
    ("no metrics collection", {}, {"_system_config": {"enable_metrics_collection": False}}),
    ("no Train preemption watcher", {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}, {}),
    ("no Train metrics callbacks", {"RAY_TRAIN_METRICS_ENABLED": "0"}, {}),
    ("no prestarted idle workers", {}, {"_system_config": {"enable_metrics_collection": False,
                                                           "prestart_worker_first_driver": False}}),
    ("Ray Train V1 (deprecated; fewer actors)", {"RAY_TRAIN_V2_ENABLED": "0"}, {}),
]


def child(knobs: dict[str, Any]) -> None:
    """One measurement: print the seconds from this process's start to each step as JSON."""
    started = float(os.environ["BENCH_STARTED"])
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    imported = time.time()
    ray.init(log_to_driver=False, configure_logging=False, **knobs)
    initialised = time.time()
    mark = Path(tempfile.mkdtemp()) / "first-step"

    def first_step(config: dict[str, str]) -> None:
        Path(config["mark"]).write_text(str(time.time()))

    TorchTrainer(first_step, train_loop_config={"mark": str(mark)},
                 scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                 run_config=RunConfig(storage_path=str(mark.parent / "ray"))).fit()
    fitted = time.time()
    ray.shutdown()
    print(json.dumps({"import_ray": imported - started, "ray_init": initialised - started,
                      "first_train_step": float(mark.read_text()) - started, "fit_returned": fitted - started,
                      "shutdown": time.time() - started}))


def measure(env: dict[str, str], knobs: dict[str, Any]) -> dict[str, float]:
    runs = []
    for _ in range(int(os.environ.get("BENCH_STARTUP_REPEATS", 3))):
        started = time.time()
        out = subprocess.run([sys.executable, "-m", "bench.bench_startup", "child", json.dumps(knobs)],
                             env={**os.environ, **env, "BENCH_STARTED": str(started)}, capture_output=True,
                             text=True, timeout=600, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def main() -> None:
    env: dict[str, str] = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # on loopback, as the trainer does
    knobs: dict[str, Any] = {}
    rows = []
    for name, more_env, more_knobs in KNOBS:
        env.update(more_env)
        knobs.update(more_knobs)
        row = {"knob": name, **measure(env, knobs)}
        rows.append(row)
        print(row, flush=True)
    write("startup", {"what": "seconds from process start; cumulative knob sets, median of repeats",
                      "rows": rows})


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(json.loads(sys.argv[2]))
    else:
        main()
