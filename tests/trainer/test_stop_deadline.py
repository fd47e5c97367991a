"""A stop with a deadline (the trainer pod's grace period): an update that would outlast it is cut short
between optimizer steps, so that the checkpoint is written before the kubelet's SIGKILL. Unit tests on
the learner, and a real `overworld run` whose trainer is stopped in the middle of a long update."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from overworld.trainer.checkpoint import iteration_of
from overworld.trainer.stopping import STOP_MARGIN_SECONDS
from tests.support import interrupt_run
from tests.trainer.helpers import flat_params, make_batch, make_trainer

ROOT = Path(__file__).resolve().parents[2]


def test_no_deadline_trains_every_step() -> None:
    trainer = make_trainer("train_config.epochs_per_iteration=6")
    metrics = trainer.train_iteration(make_batch(trainer, 8, 32))
    assert trainer.updates == 6 and not trainer.cut_short
    assert metrics is not None and metrics["trainer/update_cut_short"] == 0.0


def test_a_deadline_too_close_for_the_checkpoint_takes_no_step() -> None:
    trainer = make_trainer("train_config.epochs_per_iteration=6")
    before = flat_params(trainer.model)
    trainer.stop_deadline.checkpoint_seconds = 1.0
    trainer.stop_deadline.at = time.monotonic() + STOP_MARGIN_SECONDS + 0.5  # not even the checkpoint fits
    metrics = trainer.train_iteration(make_batch(trainer, 8, 32))
    assert trainer.updates == 0 and trainer.cut_short
    assert metrics is not None and metrics["trainer/update_cut_short"] == 1.0
    assert (flat_params(trainer.model) == before).all()


def test_the_update_stops_where_one_more_step_would_miss_the_deadline() -> None:
    trainer = make_trainer("train_config.epochs_per_iteration=100000")
    trainer.stop_deadline.checkpoint_seconds = 0.5
    trainer.stop_deadline.at = time.monotonic() + STOP_MARGIN_SECONDS + 2.5
    trainer.train_iteration(make_batch(trainer, 8, 32))
    late = time.monotonic() - trainer.stop_deadline.at
    assert trainer.cut_short and 0 < trainer.updates < 100000
    # what is left before the deadline holds the checkpoint and the margin
    assert late <= -(0.5 + STOP_MARGIN_SECONDS) + 0.2, late


def seconds_of(line: str) -> float:
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    assert stamp, line
    return time.mktime(time.strptime(stamp.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp.group(1)[20:]) / 1000


@pytest.mark.slow
def test_a_trainer_stopped_mid_update_checkpoints_within_its_grace(tmp_path: Path) -> None:
    # one iteration's update takes about a minute (30,000 epochs); the trainer's grace period is 12 s
    grace = 12
    workdir = tmp_path / "run"
    text = interrupt_run(ROOT / "examples" / "cartpole.yaml", workdir, "first batch in: updating",
                         "--set", "train_config.epochs_per_iteration=30000", then_wait=3,
                         env={"OVERWORLD_STOP_GRACE_SECONDS": str(grace)})
    assert "update of iteration 1 cut short" in text, text[-3000:]
    lines = text.splitlines()
    signalled = next(seconds_of(line) for line in lines if "received SIGTERM" in line)
    stopped = next(seconds_of(line) for line in lines if "stopped cleanly" in line)
    # without the deadline read, the stop waits for the rest of the update (minutes)
    assert stopped - signalled <= grace, text[-3000:]
    # the iteration cut short is the one checkpointed
    assert [p for p in workdir.rglob("iter-*") if iteration_of(p.name.split(".")[0]) == 1], sorted(workdir.rglob("*"))
