"""MineStudio's metrics where its users look (W&B, TensorBoard, console), added to every iteration's
metrics on rank 0 (a post_iteration hook, before the loggers):

- `episode_statistics/{task}4train/{sum_reward, discounted_reward, episode_length, episode_count,
  frequency}`: means over the episodes that ended since the last iteration, per task label (the
  episode's `obs["task"]`, else `task_name`, else empty as in MineStudio), and the run-wide
  `episode_statistics/{step, steps, episode_count, mean_sum_reward, mean_test_sum_reward,
  mean_discounted_reward, mean_episode_length}` (MineStudio's EpisodeStatistics.log_statistics);
- `replay_buffer/{fragments_per_second, replay_buffer_size (chunk), model_version, avg_reuse,
  avg_staleness}` from the replay buffer's statistics;
- `trainer/env_SPS_all_workers`: env steps per second of the whole fleet since the last iteration;
- `crafter/{task}/score` and `crafter/{task}/success_rate/{achievement}` for tasks whose episodes
  report Crafter's achievements: over all the run's episodes, as the benchmark scores a run.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from overworld.core.config import RunConfig
from overworld.envs.crafter_score import score_summary
from overworld.trainer.hooks import Runtime

log = logging.getLogger("overworld.trainer")


def default_task_label(config: RunConfig) -> str:
    """The label workers give episodes whose env names no task (rollout_worker/worker.py)."""
    return config.task_name or config.env_generator.rsplit(":", 1)[-1]


def minestudio_task(task: str, config: RunConfig) -> str:
    """MineStudio's its_specfg + "4train": the episode's own task, or "" when it has none."""
    own = "" if not config.task_name and task in (default_task_label(config), "default") else task
    return f"{own}4train"


class MineStudioMetrics:
    def __init__(self) -> None:
        self.tasks: dict[str, tuple[int, float, float, int]] = {}
        self.inserted: tuple[float, int] | None = None
        self.env_steps: tuple[float, int] | None = None

    def __call__(self, trainer: Runtime, metrics: dict[str, float]) -> None:
        if trainer.rank != 0:
            return
        try:
            fleet = trainer.manager.fleet_status(timeout=5)
            stats = trainer.buffer.stats(timeout=5.0)
        except Exception as err:  # statistics only: never stall training on them
            log.warning("MineStudio metrics skipped this iteration: %s", err)
            return
        now = time.monotonic()
        metrics.update(self.episode_statistics(fleet, trainer.config, trainer.env_steps))
        metrics.update(crafter_metrics(fleet))
        if self.inserted is not None and now > self.inserted[0]:
            metrics["replay_buffer/fragments_per_second"] = (
                (stats.inserted_fragments - self.inserted[1]) / (now - self.inserted[0]))
        self.inserted = (now, stats.inserted_fragments)
        metrics.update({"replay_buffer/replay_buffer_size (chunk)": float(stats.chunks),
                        "replay_buffer/model_version": float(stats.model_version),
                        "replay_buffer/avg_reuse": stats.mean_reuse, "replay_buffer/avg_staleness": stats.mean_staleness})
        if self.env_steps is not None and now > self.env_steps[0]:
            metrics["trainer/env_SPS_all_workers"] = (fleet.env_steps - self.env_steps[1]) / (now - self.env_steps[0])
        self.env_steps = (now, fleet.env_steps)

    def episode_statistics(self, fleet: Any, config: RunConfig, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        new: dict[str, tuple[int, float, float, int]] = {}
        for t in fleet.tasks:
            before = self.tasks.get(t.task, (0, 0.0, 0.0, 0))
            now = (t.episodes, t.total_return, t.total_discounted_return, t.total_length)
            self.tasks[t.task] = now
            if now[0] > before[0]:
                new[t.task] = tuple(a - b for a, b in zip(now, before, strict=True))
        count = sum(n for n, *_ in new.values())
        if not count:
            return out
        train = []
        for task, (n, ret, disc, length) in sorted(new.items()):
            name = minestudio_task(task, config)
            means = {"sum_reward": ret / n, "discounted_reward": disc / n, "episode_length": length / n}
            out.update({f"episode_statistics/{name}/{k}": v for k, v in means.items()})
            out[f"episode_statistics/{name}/episode_count"] = float(n)
            out[f"episode_statistics/{name}/frequency"] = n / count
            train.append(means)
        out.update({
            "episode_statistics/step": float(step), "episode_statistics/steps": float(step),
            "episode_statistics/episode_count": float(count),
            "episode_statistics/mean_sum_reward": _mean([m["sum_reward"] for m in train]),
            "episode_statistics/mean_test_sum_reward": 0.0,  # MineStudio's "4test" tasks: none here
            "episode_statistics/mean_discounted_reward": _mean([m["discounted_reward"] for m in train]),
            "episode_statistics/mean_episode_length": _mean([m["episode_length"] for m in train]),
        })
        return out


def crafter_metrics(fleet: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in fleet.tasks:
        summary = score_summary(t.total_extras, t.episodes)
        if summary is not None:
            out[f"crafter/{t.task}/score"] = summary["score"]
            out.update({f"crafter/{t.task}/success_rate/{name}": rate
                        for name, rate in summary["success_rates"].items()})
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
