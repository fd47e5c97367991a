"""`use_amp` as MineStudio's head (after 1.1.6) means it: a BaseTrainer/PPOTrainer argument placed where
MineStudio puts it, off by default; on, the learner's forward passes run under autocast. bf16 needs no
loss scaling; fp16 (`amp_dtype: float16`, MineStudio's own choice) gets a GradScaler whose state is saved
in the checkpoint, restored on resume (with resume_optimizer, as MineStudio) and exported as MineStudio's
scaler.ckpt. Both run here on the CPU (torch's CPU autocast and CPU GradScaler); fp16 on CUDA is checked
by the GPU check (docs/gpu_check.md) where a GPU is at hand."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from overworld.core.config import ConfigError
from overworld.online import BaseTrainer, PPOTrainer
from overworld.trainer.checkpoint import checkpoint_store
from overworld.trainer.minestudio_checkpoint import SCALER, export_checkpoint, load_weights_only
from tests.trainer.helpers import ROOT, flat_params, make_batch, make_trainer

BASE = ["train_config.epochs_per_iteration=1", "train_config.batches_per_iteration=2",
        "train_config.batch_size_per_gpu=4", "train_config.context_length=8"]


def test_use_amp_is_an_argument_where_minestudio_has_it_and_off_by_default() -> None:
    names = list(inspect.signature(BaseTrainer.__init__).parameters)
    # MineStudio's head: ..., inference_batch_size_per_gpu, use_amp, resume, resume_optimizer, **kwargs
    at = names.index("use_amp")
    assert names[at - 1:at + 3] == ["inference_batch_size_per_gpu", "use_amp", "resume", "resume_optimizer"]
    from overworld.core.config import load_config

    config = load_config(ROOT / "examples" / "cartpole.yaml")
    assert config.train_config.use_amp is False
    off = PPOTrainer("m:1", config=config)
    on = PPOTrainer("m:1", config=config, use_amp=True)  # MineStudio's PPOTrainer hands it on to BaseTrainer
    assert (off.use_amp, on.use_amp, on.config.train_config.use_amp) == (False, True, True)
    assert config.train_config.use_amp is False  # the caller's config is not changed
    with pytest.raises(ConfigError, match="amp_dtype"):
        load_config(ROOT / "examples" / "cartpole.yaml", ["train_config.amp_dtype=half"])


def forward_dtypes(trainer: PPOTrainer) -> list[torch.dtype]:
    """The output dtypes of the policy's first linear layer, recorded on every forward."""
    seen: list[torch.dtype] = []
    layer = next(m for m in trainer.unwrapped_model.modules() if isinstance(m, torch.nn.Linear))
    layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("amp", [None, "bfloat16", "float16"])
def test_the_update_runs_under_autocast_and_keeps_float32_weights(amp: str | None) -> None:
    extra = ["train_config.use_amp=true", f"train_config.amp_dtype={amp}"] if amp else []
    trainer = make_trainer(*BASE, *extra)
    expected = {None: torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[amp]
    assert trainer.amp_dtype == (None if amp is None else expected)
    assert (trainer.scaler is not None) == (amp == "float16")  # bf16 needs no loss scaling
    batch = make_batch(trainer, B=8, L=16)
    seen = forward_dtypes(trainer)
    before = flat_params(trainer.unwrapped_model)
    metrics = trainer.update(batch)
    assert seen and set(seen) == {expected}
    assert metrics["trainer/skipped_steps"] == 0 and trainer.updates == 2
    after = flat_params(trainer.unwrapped_model)
    assert after.dtype == torch.float32 and torch.isfinite(after).all() and not torch.equal(before, after)
    if amp == "float16":
        assert trainer.scaler.get_scale() == 65536.0  # the default start, kept: no overflow in two steps


def test_auto_is_bf16_on_the_cpu() -> None:
    trainer = make_trainer(*BASE, "train_config.use_amp=true")
    assert trainer.amp_dtype == torch.bfloat16 and trainer.scaler is None


def test_the_fp16_scaler_state_is_checkpointed_restored_and_exported(tmp_path: Path) -> None:
    overrides = [*BASE, "train_config.use_amp=true", "train_config.amp_dtype=float16", "run_id=amp"]
    first = make_trainer(*overrides)
    first.workdir = str(tmp_path)
    first.checkpoints = checkpoint_store(first.config, first.workdir)
    first.iteration = 1
    first.update(make_batch(first, B=8, L=16))
    first.scaler.update(new_scale=512.0)  # a state a fresh scaler does not have
    first.iteration = 3
    ckpt = first.save_checkpoint()

    resumed = make_trainer(*overrides, "train_config.resume=latest")
    resumed.workdir, resumed.checkpoints = first.workdir, checkpoint_store(first.config, first.workdir)
    assert resumed.scaler.get_scale() == 65536.0
    resumed.restore()
    assert resumed.resumed_from == ckpt and resumed.scaler.get_scale() == 512.0
    assert resumed.scaler.state_dict() == first.scaler.state_dict()

    without = make_trainer(*overrides, "train_config.resume=latest", "train_config.resume_optimizer=false")
    without.workdir, without.checkpoints = first.workdir, checkpoint_store(first.config, first.workdir)
    without.restore()  # MineStudio restores the scaler with the optimizer only
    assert without.resumed_from == ckpt and without.scaler.get_scale() == 65536.0

    out = export_checkpoint(str(tmp_path / "output" / "amp" / "checkpoints" / ckpt), str(tmp_path / "minestudio"))
    assert load_weights_only(out / SCALER)["scale"] == 512.0


def test_without_amp_no_scaler_is_saved(tmp_path: Path) -> None:
    trainer = make_trainer(*BASE, "run_id=noamp")
    trainer.workdir = str(tmp_path)
    trainer.checkpoints = checkpoint_store(trainer.config, trainer.workdir)
    trainer.iteration = 1
    trainer.update(make_batch(trainer, B=8, L=16))
    ckpt = trainer.save_checkpoint()
    files = {p.name for p in (tmp_path / "output" / "noamp" / "checkpoints" / ckpt).iterdir()}
    assert "model.safetensors" in files and "scaler.pt" not in files
