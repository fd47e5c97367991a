"""Named points of the training loop where hooks run (in registration order).

The built-in behaviours — learning-rate annealing, KL-coefficient decay, publishing weights,
checkpoints, evaluation, logging — are hooks themselves (trainer/builtin_hooks.py), so a custom
trainer can replace or extend any of them. A hook is a callable `hook(trainer, **context)`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

POINTS = (
    "pre_collect",       # before fetching an iteration's batch
    "post_collect",      # batch=Batch, advantages estimated
    "post_loss",         # terms=LossTerms of one context window
    "pre_optim_step",    # gradients accumulated, not yet clipped
    "post_optim_step",   # skipped=bool
    "post_epoch",        # epoch=int
    "post_iteration",    # metrics=dict (hooks may add to it)
    "on_checkpoint",     # checkpoint_id=str
    "on_evaluate",       # results=dict
)

Hook = Callable[..., Any]


class Hooks:
    def __init__(self) -> None:
        self._hooks: dict[str, list[Hook]] = defaultdict(list)

    def register(self, point: str, hook: Hook) -> None:
        if point not in POINTS:
            raise ValueError(f"unknown hook point {point!r}; one of {', '.join(POINTS)}")
        self._hooks[point].append(hook)

    def run(self, point: str, trainer: Any, **context: Any) -> None:
        for hook in self._hooks[point]:
            hook(trainer, **context)

    def registered(self, point: str) -> list[Hook]:
        return list(self._hooks[point])
