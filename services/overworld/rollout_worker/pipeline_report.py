"""MineStudio's pipeline monitor (`worker_config.log_interval`, `moving_stat_duration`): every
`log_interval` seconds the worker logs the moving averages, over the last `moving_stat_duration`
seconds, of its stages (env step, inference) and of the inference queue, as MineStudio's
RolloutWorker prints them; `max_fast_reset` rides along, as in MineStudio's EnvWorker progress line."""

from __future__ import annotations

import logging
import math
import time
from collections import deque

log = logging.getLogger("overworld.rollout_worker.pipeline")


class MovingStat:
    """Mean of the values seen in the last `duration` seconds."""

    def __init__(self, duration: float) -> None:
        self.duration = duration
        self.values: deque[tuple[float, float]] = deque()
        self.total = 0.0

    def update(self, x: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.values.append((now, x))
        self.total += x
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self.values and now - self.values[0][0] > self.duration:
            self.total -= self.values.popleft()[1]

    def average(self, now: float | None = None) -> float:
        self._expire(time.monotonic() if now is None else now)
        return self.total / len(self.values) if self.values else math.nan


class PipelineReport:
    STAGES = ("env_step", "inference", "queue_size_after_inference")

    def __init__(self, log_interval: float | None, duration: float, max_fast_reset: int) -> None:
        self.log_interval = log_interval
        self.max_fast_reset = max_fast_reset
        self.stats = {stage: MovingStat(duration) for stage in self.STAGES}
        self.last = time.monotonic()

    def update(self, stage: str, value: float) -> None:
        if self.log_interval is not None:
            self.stats[stage].update(value)

    def maybe_log(self, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        if self.log_interval is None or now - self.last < self.log_interval:
            return None
        self.last = now
        env_step, inference = self.stats["env_step"], self.stats["inference"]
        line = (f"pipeline (moving averages over {env_step.duration:.0f}s): env_step "
                f"{1000 * env_step.average(now):.2f} ms, inference {1000 * inference.average(now):.2f} ms, "
                f"queue size after inference {self.stats['queue_size_after_inference'].average(now):.2f}; "
                f"max_fast_reset {self.max_fast_reset}")
        log.info(line)
        return line
