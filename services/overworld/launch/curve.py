"""The run's figures as data: a learning-curve point per progress tick (`<workdir>/progress.jsonl`),
and the summary's figures per task. What a task reports beyond return and length is what it declares
(envs/task_metrics.py), not a list kept here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from overworld.envs.task_metrics import TaskMetrics


def curve_point(elapsed: float, env_steps: int, fleet: Any, trainer: Any, task_metrics: TaskMetrics,
                push_seconds: float | None = None) -> dict[str, Any]:
    """The learning curve against env steps and wall time at one moment, with the trainer's last
    iteration's timings (`trainer/*_seconds`) and the registry's last push latency."""
    point = {"wall_seconds": round(elapsed, 2), "env_steps": env_steps, "episodes": fleet.episodes,
             "mean_return_last_100": fleet.mean_return_last_100 if fleet.episodes else None,
             "model_version": trainer.model_version, "updates": trainer.updates, "iteration": trainer.iteration}
    for task in fleet.tasks:
        point.update(task_metrics.curve(task))
    point.update({k: round(v, 4) for k, v in trainer.metrics.items() if k.endswith("_seconds")})
    if push_seconds is not None:
        point["registry/push_seconds"] = round(push_seconds, 4)
    return point


def append_point(path: Path, point: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(point) + "\n")


def task_figures(fleet: Any, task_metrics: TaskMetrics) -> dict[str, dict[str, Any]]:
    """Per task: its episodes, return and length (last 100), the means of every extra it sends, and the
    scores it declares."""
    return {t.task: {"episodes": t.episodes, "mean_return_last_100": t.mean_return_last_100,
                     "mean_length_last_100": t.mean_length_last_100, **dict(t.mean_extras_last_100),
                     **task_metrics.score(t)}
            for t in fleet.tasks}
