"""MineStudio's `resume`: None starts fresh (even when the run has checkpoints); `latest` resumes; a
restarted trainer (`--resume auto`) continues its run; `save_path: None` is the default location."""

from __future__ import annotations

from pathlib import Path

import torch

from overworld.trainer.checkpoint import checkpoint_store
from tests.trainer.helpers import flat_params, make_trainer


def _trainer(tmp_path: Path, *overrides: str, continue_run: bool = False):  # type: ignore[no-untyped-def]
    trainer = make_trainer("run_id=r1", *overrides)
    trainer.workdir = str(tmp_path)
    trainer.continue_run = continue_run  # a restarted trainer (the driver's --resume auto)
    trainer.checkpoints = checkpoint_store(trainer.config, trainer.workdir)
    return trainer


def test_resume_none_starts_fresh_latest_and_restarts_continue(tmp_path: Path) -> None:
    first = _trainer(tmp_path, "train_config.save_path=null")
    with torch.no_grad():
        for p in first.unwrapped_model.parameters():
            p.add_(1.0)
    first.iteration, first.model_version = 7, 7
    assert first.save_checkpoint() == "iter-00000007"
    assert (tmp_path / "output" / "r1" / "checkpoints" / "iter-00000007" / "COMMITTED").exists()  # default place

    fresh = _trainer(tmp_path, "train_config.save_path=null")  # resume: None, MineStudio's default
    fresh.restore()
    assert fresh.iteration == 0 and fresh.resumed_from is None
    assert not torch.equal(flat_params(fresh.unwrapped_model), flat_params(first.unwrapped_model))

    latest = _trainer(tmp_path, "train_config.save_path=null", "train_config.resume=latest")
    latest.restore()
    assert latest.iteration == 7 and latest.resumed_from == "iter-00000007"
    torch.testing.assert_close(flat_params(latest.unwrapped_model), flat_params(first.unwrapped_model))

    restarted = _trainer(tmp_path, "train_config.save_path=null", continue_run=True)
    restarted.restore()
    assert restarted.iteration == 7 and restarted.model_version == 7
