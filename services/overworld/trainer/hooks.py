"""Named points of the training loop where hooks run (in registration order).

The built-in behaviours around an iteration (publishing weights, checkpoints, evaluation, logging)
are hooks themselves (trainer/builtin_hooks.py), so a custom trainer can replace or extend any of
them. A hook is a callable `hook(trainer, **context)`.

The runtime's loop runs the points around an iteration; the points inside the algorithm are
declared on the learner's method they surround (`@around`), so the algorithm's body calls no hook.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from overworld.core.config import RunConfig
from overworld.policies.base import Policy
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.client import RolloutManagerClient

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


class Runtime(Protocol):
    """What a hook may use of the trainer it runs in: trainer/runtime.py's TrainerRuntime (and so the
    learner, and MineStudio's trainers, built on it)."""

    config: RunConfig
    hooks: Hooks
    rank: int
    iteration: int  # 1 during the first
    env_steps: int  # the run's, every worker's
    workdir: str
    device: torch.device
    manager: RolloutManagerClient
    buffer: ReplayBufferClient

    @property
    def unwrapped_model(self) -> Policy: ...

    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None: ...

    def save_checkpoint(self) -> str: ...


class Hooks:
    def __init__(self) -> None:
        self._hooks: dict[str, list[Hook]] = defaultdict(list)

    def register(self, point: str, hook: Hook) -> None:
        if point not in POINTS:
            raise ValueError(f"unknown hook point {point!r}; one of {', '.join(POINTS)}")
        self._hooks[point].append(hook)

    def run(self, point: str, trainer: Runtime, **context: Any) -> None:
        for hook in self._hooks[point]:
            hook(trainer, **context)

    def registered(self, point: str) -> list[Hook]:
        return list(self._hooks[point])


Method = TypeVar("Method", bound=Callable[..., Any])


def around(after: str, *, before: str | None = None, result: str | None = None,
           arguments: tuple[str, ...] = ()) -> Callable[[Method], Method]:
    """Declares a learner method as a hook point: the trainer's `before` hooks run when it is called,
    its `after` hooks when it returns, given its return value as `result` and the named `arguments`."""
    for point in (after, before):
        if point is not None and point not in POINTS:
            raise ValueError(f"unknown hook point {point!r}; one of {', '.join(POINTS)}")

    def declare(method: Method) -> Method:
        signature = inspect.signature(method)
        missing = [name for name in arguments if name not in signature.parameters]
        if missing:
            raise TypeError(f"{method.__qualname__} has no argument {', '.join(missing)} to give the {after} hooks")

        @functools.wraps(method)
        def run(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                trainer.hooks.run(before, trainer)
            value = method(trainer, *args, **kwargs)
            context = {}
            if arguments:
                given = signature.bind(trainer, *args, **kwargs)
                given.apply_defaults()
                context = {name: given.arguments[name] for name in arguments}
            if result is not None:
                context[result] = value
            trainer.hooks.run(after, trainer, **context)
            return value

        return run  # type: ignore[return-value]

    return declare
