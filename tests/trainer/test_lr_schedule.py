"""The learning-rate schedule lives beside the optimizer (`setup_lr_schedule`, the runtime's, so MineStudio-style
subclasses that bring their own optimizer get it too): a resumed
trainer trains its next iteration at the rate the schedule had reached, from the checkpoint's
lr_schedule.pt, or, for a checkpoint written before schedules were saved or a fresh optimizer, from the
iteration. (The loop stepping it once per iteration: tests/trainer/test_local_mode_without_ray.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from overworld.trainer.checkpoint import checkpoint_store
from overworld.trainer.learner import PPOLearner
from tests.trainer.helpers import make_trainer

BASE = ["train_config.learning_rate=0.001", "train_config.anneal_lr_linearly=true",
        "train_config.num_iterations=10", "run_id=schedule"]


def trained(tmp_path: Path, *overrides: str) -> PPOLearner:
    trainer = make_trainer(*BASE, *overrides)
    trainer.workdir = str(tmp_path)
    trainer.checkpoints = checkpoint_store(trainer.config, trainer.workdir)
    return trainer


def rate(trainer: PPOLearner) -> float:
    return float(trainer.optimizer.param_groups[0]["lr"])


def test_iteration_i_trains_at_one_minus_i_minus_one_over_n() -> None:
    trainer = make_trainer(*BASE)
    rates = []
    for _ in range(12):
        rates.append(rate(trainer))
        trainer.lr_schedule.step()
    assert rates == pytest.approx([0.001 * max(0.0, 1 - i / 10) for i in range(12)])
    constant = make_trainer(*BASE, "train_config.anneal_lr_linearly=false")
    constant.lr_schedule.step()
    assert rate(constant) == 0.001


@pytest.mark.parametrize("how", ["saved schedule", "older checkpoint", "fresh optimizer"])
def test_a_resumed_trainer_goes_on_at_the_rate_the_schedule_reached(tmp_path: Path, how: str) -> None:
    first = trained(tmp_path)
    for iteration in range(1, 4):
        first.iteration = iteration
        first.lr_schedule.step()
    first.save_checkpoint()
    if how == "older checkpoint":
        (tmp_path / "output" / "schedule" / "checkpoints" / "iter-00000003" / "lr_schedule.pt").unlink()
    overrides = ["train_config.resume=latest"] + (["train_config.resume_optimizer=false"] if how == "fresh optimizer"
                                                 else [])
    second = trained(tmp_path, *overrides)
    assert rate(second) == 0.001
    second.restore()
    assert second.iteration == 3
    assert rate(second) == pytest.approx(rate(first)) and rate(first) == pytest.approx(0.001 * (1 - 3 / 10))
    second.lr_schedule.step()
    assert rate(second) == pytest.approx(0.001 * (1 - 4 / 10))
