"""`overworld run`'s progress line, against the budget the run runs to (`--max-env-steps`,
`train_config.num_iterations`, `--target-return`: whichever comes first ends it): the totals, the
percent done and the time left. On a terminal it is one line rewritten in place; written to a file or
a pipe, a plain line now and then."""

from __future__ import annotations

import shutil
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, TextIO

CLEAR_TO_END_OF_LINE = "\x1b[K"
TTY_INTERVAL_SECONDS = 1.0
PLAIN_INTERVAL_SECONDS = 10.0
RATE_WINDOW_SECONDS = 60.0


@dataclass(frozen=True)
class Budget:
    """What the run runs to; None: not a limit of this run."""

    max_env_steps: int | None = None
    iterations: int | None = None  # train_config.num_iterations: the trainer finishes there
    target_return: float | None = None  # the mean return of the last 100 episodes
    keep_going: bool = False  # at the target return: note when (steps_to_target) and run on to the other limits


@dataclass(frozen=True)
class Snapshot:
    """The run at one moment, as the rollout-manager and the trainer report it."""

    wall_seconds: float  # since `overworld run` started the services
    env_steps: int
    iteration: int
    episodes: int
    mean_return_last_100: float | None  # None before the first episode
    model_version: int
    updates: int
    lag: float  # versions the workers run behind the learner, on average
    workers: int
    samples_trained: int = 0  # env steps the learner has trained on (each once, however many epochs)

    @property
    def used(self) -> float | None:
        """The share of the env steps that the learner trained on: low when the fleet steps more than the
        learner samples (its data goes stale at the buffer's door); None before the learner trained. At
        most 1 while running: the fleet's steps arrive with its heartbeats (up to 2 s late), so the learner
        can be ahead of them; the summary's `env_steps_used` is read once the fleet has stopped."""
        if not self.env_steps or not self.samples_trained:
            return None
        return min(1.0, self.samples_trained / self.env_steps)

    @classmethod
    def of(cls, fleet: Any, trainer: Any, wall_seconds: float, offset: int = 0) -> Snapshot:
        """From a FleetStatus and a TrainerStatus; `offset`: the env steps before a resumed run started."""
        versions = [w.model_version for w in fleet.workers]
        # Workers can be ahead of the trainer's last status: they read a version from the registry first.
        lag = max(0.0, trainer.model_version - sum(versions) / len(versions)) if versions else 0.0
        return cls(round(wall_seconds, 2), offset + fleet.env_steps, getattr(trainer, "iteration", 0), fleet.episodes,
                   fleet.mean_return_last_100 if fleet.episodes else None, trainer.model_version, trainer.updates,
                   lag, len(fleet.workers), getattr(trainer, "samples_trained", 0))


class Rate:
    """Units per second of a growing count over the last `window` seconds (the run's pace now, not its
    average since a start that counted nothing for a while)."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, at: float, count: float) -> None:
        self.samples.append((at, count))
        while len(self.samples) > 2 and at - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def per_second(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 and c1 > c0 else None


def time_left(snapshot: Snapshot, budget: Budget, steps_per_second: float | None,
              iterations_per_second: float | None) -> float | None:
    """Seconds until the first counted budget is reached at the current pace (a target return has no
    pace to extrapolate); None when no counted budget has a pace yet."""
    left = []
    if budget.max_env_steps and steps_per_second:
        left.append(max(0, budget.max_env_steps - snapshot.env_steps) / steps_per_second)
    if budget.iterations and iterations_per_second:
        left.append(max(0, budget.iterations - snapshot.iteration) / iterations_per_second)
    return min(left) if left else None


def format_duration(seconds: float | None) -> str:
    """`m:ss`, or `h:mm:ss` from an hour on; `--:--` when unknown."""
    if seconds is None:
        return "--:--"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def of_total(done: int, total: int | None) -> str:
    """`/total (p%)` when there is a total, else nothing."""
    if not total:
        return ""
    return f"/{total:,} ({min(100.0, 100.0 * done / total):.0f}%)"


def format_progress(snapshot: Snapshot, budget: Budget, steps_per_second: float | None = None,
                    iterations_per_second: float | None = None) -> str:
    s = snapshot
    ret = "n/a" if s.mean_return_last_100 is None else f"{s.mean_return_last_100:.2f}"
    target = "" if budget.target_return is None else f"/{budget.target_return:g}"
    rate = "" if steps_per_second is None else f" {steps_per_second:,.0f}/s"
    left = time_left(s, budget, steps_per_second, iterations_per_second)
    used = "" if s.used is None else f" used {s.used:.0%}"
    # Most telling first: a terminal narrower than the line cuts its end.
    return (f"[{format_duration(s.wall_seconds):>7}] left {format_duration(left)}  "
            f"env steps {s.env_steps:,}{of_total(s.env_steps, budget.max_env_steps)}{rate}  "
            f"iteration {s.iteration:,}{of_total(s.iteration, budget.iterations)}  return(100) {ret}{target}  "
            f"episodes {s.episodes:,}  model v{s.model_version} updates {s.updates:,} lag {s.lag:.1f}{used}  "
            f"workers {s.workers}")


class ProgressDisplay:
    """On a terminal: one line rewritten in place (carriage return), cut to the terminal's width so that
    it never wraps, every TTY_INTERVAL_SECONDS. Otherwise (a file, a pipe): a plain line every
    PLAIN_INTERVAL_SECONDS. Other output goes through `message`, which ends the progress line first."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = TTY_INTERVAL_SECONDS if self.tty else PLAIN_INTERVAL_SECONDS
        self.last_shown: float | None = None
        self.line_open = False  # a progress line without its newline is on the terminal

    def due(self, now: float) -> bool:
        return self.last_shown is None or now - self.last_shown >= self.interval

    def show(self, line: str, now: float) -> None:
        self.last_shown = now
        if self.tty:
            width = shutil.get_terminal_size().columns
            self.stream.write("\r" + line[:max(1, width - 1)] + CLEAR_TO_END_OF_LINE)
            self.line_open = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str, stream: TextIO | None = None) -> None:
        self.close()
        print(text, file=stream or self.stream, flush=True)

    def close(self) -> None:
        if self.line_open:
            self.stream.write("\n")
            self.stream.flush()
            self.line_open = False
