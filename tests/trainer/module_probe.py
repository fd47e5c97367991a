"""A trainer hook (`train_config.hooks: ["tests/trainer/module_probe.py:install"]`) that records which
top-level modules the trainer process has imported, and its learning rate: after every iteration and once more when the
process exits (after the driver's stop, which is where Ray used to be shut down), as JSON lines in
$OVERWORLD_MODULE_PROBE."""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any


def _record(where: str, trainer: Any) -> None:
    path = os.environ.get("OVERWORLD_MODULE_PROBE")
    if not path:
        return
    entry = {"where": where, "pid": os.getpid(), "iteration": trainer.iteration, "world_size": trainer.world_size,
             "device": str(trainer.device), "learning_rate": trainer.optimizer.param_groups[0]["lr"],
             "modules": sorted({name.split(".")[0] for name in list(sys.modules)})}
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def install(trainer: Any) -> None:
    trainer.hooks.register("post_iteration", lambda t, metrics: _record("post_iteration", t))
    atexit.register(_record, "exit", trainer)
