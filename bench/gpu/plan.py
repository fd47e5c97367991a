"""The one device call of the GPU check and its time plan (docs/gpu_check.md).

The call is written once, in docs/gpu_check.md, as the device tool's arguments (command, carry,
timeout_s); `documented_call` reads it from there for the stand-in box, the collector and the tests.
Standard library only: this runs on the box's Python 3.12 before anything is installed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "gpu_check.md"
CALL_MARKER = "<!-- the gpu-check call: the device tool's arguments -->"

STEPS = ("rollout", "vpt2x", "amp_fp16", "crafter")
# The command exports the moment it started: the budget counts the wheel install too.
STARTED_ENV = "GPU_CHECK_STARTED"
# Set by the stand-in box only (bench/gpu/box_standin.py): every step on the CPU at tiny sizes.
STAND_IN_ENV = "GPU_CHECK_STAND_IN"
# The stand-in's shortened budget; the box runs on its plan's.
BUDGET_ENV = "GPU_CHECK_BUDGET"
# The driver's version, read once by the supervisor (nvidia-smi) for every step's record.
DRIVER_ENV = "GPU_CHECK_DRIVER"
# Where a step keeps its working files, below the checkout (nothing of it has to come back).
WORKDIR = Path("runs") / "gpu-check"


@dataclass(frozen=True)
class Plan:
    """Seconds, counted from the command's start."""

    budget: float  # every result is in $OUT by then
    caps: dict[str, float] = field(default_factory=dict)  # a step's own limit (the probe's included)
    crafter_least: float = 0.0  # an earlier step is cut short rather than leave Crafter less than this
    crafter_stop: float = 0.0  # Crafter is asked to stop this long before the end, for its summary
    end_margin: float = 0.0  # the last result is written this long before the budget's end


# 8.5 minutes: a 540 s timeout_s leaves 30 s, and the machine's start, the transfers and its 30 s idle
# still fit a 15-minute lease. The caps are about twice what the steps should take on an H100.
BOX = Plan(budget=510.0, caps={"probe": 120.0, "rollout": 150.0, "vpt2x": 180.0, "amp_fp16": 90.0},
           crafter_least=150.0, crafter_stop=40.0, end_margin=5.0)
# Tiny steps on 2 cores: about 1.5 minutes of work before Crafter (whose start and stop take 20-30 s each
# there), with room for twice that on a busy machine.
STAND_IN = Plan(budget=300.0, caps={"probe": 90.0, "rollout": 120.0, "vpt2x": 90.0, "amp_fp16": 90.0},
                crafter_least=80.0, crafter_stop=25.0, end_margin=3.0)


def stand_in() -> bool:
    return os.environ.get(STAND_IN_ENV) == "1"


def current_plan() -> Plan:
    plan = STAND_IN if stand_in() else BOX
    budget = os.environ.get(BUDGET_ENV)
    return Plan(float(budget), plan.caps, plan.crafter_least, plan.crafter_stop, plan.end_margin) if budget else plan


def started_at() -> float:
    """Unix time of the command's start (now, when the command did not say)."""
    return float(os.environ.get(STARTED_ENV) or time.time())


def documented_call(doc: Path = DOC) -> dict:
    """The device call as docs/gpu_check.md gives it: the JSON block after CALL_MARKER."""
    text = doc.read_text()
    if CALL_MARKER not in text:
        raise ValueError(f"{doc} has no {CALL_MARKER!r}")
    block = text.split(CALL_MARKER, 1)[1].split("```json", 1)[1].split("```", 1)[0]
    return json.loads(block)
