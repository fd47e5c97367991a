"""What a task reports beyond its return and length, declared by the task itself: the module of an env
generator may define `TASK_METRICS` (a TaskMetrics). `overworld run` reads it to put those figures on
the learning curve (progress.jsonl) and in the run's summary; a task that declares none reports the
generic ones (return, length, and the means of every episode extra it sends)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# (the sums of each episode extra over all the run's episodes of a task, how many episodes) -> the figures
# of one score (a "score" among them), or None while there is nothing to score.
Scorer = Callable[[Mapping[str, float], int], Mapping[str, Any] | None]


class TaskStatistics(Protocol):
    """What the rollout-manager keeps per task (rollout_manager.proto TaskStats)."""

    task: str
    episodes: int
    mean_extras_last_100: Mapping[str, float]
    total_extras: Mapping[str, float]


@dataclass(frozen=True)
class TaskMetrics:
    # Episode extras whose mean over the task's last 100 episodes goes on the learning curve.
    curve_extras: tuple[str, ...] = ()
    # name -> scorer: its figures go in the summary under the task as `name`, its "score" on the learning
    # curve as `<task>/<name>_score`.
    scores: Mapping[str, Scorer] = field(default_factory=dict)

    def curve(self, task: TaskStatistics) -> dict[str, float]:
        out = {f"{task.task}/{k}": v for k, v in task.mean_extras_last_100.items() if k in self.curve_extras}
        for name, figures in self.score(task).items():
            out[f"{task.task}/{name}_score"] = figures["score"]
        return out

    def score(self, task: TaskStatistics) -> dict[str, Mapping[str, Any]]:
        return {name: figures for name, scorer in self.scores.items()
                if (figures := scorer(dict(task.total_extras), task.episodes)) is not None}


NO_TASK_METRICS = TaskMetrics()


def declared_task_metrics(env_generator: Any) -> TaskMetrics:
    """The TASK_METRICS of the module that defines `env_generator` (NO_TASK_METRICS when it has none)."""
    declared = getattr(inspect.getmodule(env_generator), "TASK_METRICS", None)
    return declared if isinstance(declared, TaskMetrics) else NO_TASK_METRICS
