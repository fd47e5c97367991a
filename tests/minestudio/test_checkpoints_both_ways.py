"""Checkpoints both ways with MineStudio's real VPTPolicy: a MineStudio checkpoint directory (saved as
its PPOTrainer saves one) resumes an Overworld trainer's policy and optimizer; an Overworld checkpoint
exported with `overworld export-minestudio` loads with the exact lines MineStudio's BaseTrainer resumes
with. Needs minestudio (make test-minestudio)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

pytest.importorskip("minestudio", reason="`make test-minestudio` installs minestudio in .venv-minestudio")

import torch  # noqa: E402

from overworld.cli import main  # noqa: E402
from overworld.core.blobs.urls import open_blob_store  # noqa: E402
from overworld.core.config import as_dict, load_config  # noqa: E402
from overworld.core.wire.weights import to_bytes  # noqa: E402
from overworld.policies.factory import run_spaces  # noqa: E402
from overworld.trainer.checkpoint import CheckpointStore, tensors_to_bytes  # noqa: E402
from overworld.trainer.minestudio_checkpoint import import_checkpoint  # noqa: E402
from tests.minestudio import minecraft_sim_standin  # noqa: E402

pytestmark = pytest.mark.minestudio


def _vpt(seed: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    return minecraft_sim_standin.policy_generator()


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step so that the optimizer has state to carry."""
    loss = sum((p.float() ** 2).sum() for p in model.parameters() if p.requires_grad)
    loss.backward()  # type: ignore[union-attr]
    optimizer.step()
    optimizer.zero_grad()


def _config():  # type: ignore[no-untyped-def]
    return load_config({"env_generator": "tests.minestudio.minecraft_sim_standin:env_generator",
                        "policy_generator": "tests.minestudio.minecraft_sim_standin:policy_generator",
                        "train_config": {"use_normalized_vf": True}})


def test_a_minestudio_checkpoint_resumes_an_overworld_policy(tmp_path: Path) -> None:
    mine = _vpt(1)  # MineStudio's PPOTrainer: AdamW over model.parameters(), torch.save of both state dicts
    with torch.no_grad():
        mine.value_head.normalizer.running_mean.fill_(0.5)
        mine.value_head.normalizer.running_mean_sq.fill_(0.5)
        mine.value_head.normalizer.debiasing_term.fill_(1.0)
    mine_opt = torch.optim.AdamW(mine.parameters(), lr=2e-5, weight_decay=0.04)
    _step(mine, mine_opt)
    torch.save(mine.state_dict(), tmp_path / "model.ckpt")
    torch.save(mine_opt.state_dict(), tmp_path / "optimizer.ckpt")

    torch.manual_seed(2)
    _, policy, _, _ = run_spaces(_config())  # Overworld's view of another, random VPT
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-5)
    loaded = import_checkpoint(str(tmp_path), policy, optimizer)
    for name, value in mine.state_dict().items():
        torch.testing.assert_close(policy.state_dict()[f"mine.{name}"], value)
    assert loaded["optimizer_states"] > 0
    by_name = dict(mine.named_parameters())
    ours = [n.removeprefix("mine.") for n, p in policy.named_parameters() if p.requires_grad]
    for i, name in enumerate(ours):
        torch.testing.assert_close(optimizer.state_dict()["state"][i]["exp_avg"], mine_opt.state[by_name[name]]["exp_avg"])
    assert float(policy.value_normalizer.mean) == 0.5 and float(policy.value_normalizer.debias) == 1.0


def test_an_exported_overworld_checkpoint_resumes_minestudios_trainer(tmp_path: Path) -> None:
    config = _config()
    torch.manual_seed(3)
    _, policy, _, _ = run_spaces(config)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-5)
    _step(policy, optimizer)
    with torch.no_grad():
        policy.value_normalizer.mean.fill_(0.25)
    store = CheckpointStore(open_blob_store(str(tmp_path / "ckpts")), prefix="run/checkpoints")
    store.save(4, {"config": as_dict(config), "iteration": 4},
               {"model.safetensors": to_bytes(policy.state_dict()),
                "optimizer.pt": tensors_to_bytes(optimizer.state_dict())})
    out = tmp_path / "for_minestudio"
    assert main(["export-minestudio", str(tmp_path / "ckpts/run/checkpoints/iter-00000004"), str(out)]) == 0
    assert main(["export-minestudio", str(tmp_path / "nowhere"), str(out)]) == 2  # one `error:` line
    assert pickle.loads((out / "whole_config.pkl").read_bytes()).startswith("trainer_name")

    # MineStudio's BaseTrainer._train_func, resume branch, line for line:
    inner_model = _vpt(9)
    state_dict_model = torch.load(os.path.join(out, "model.ckpt"), map_location="cpu")
    result = inner_model.load_state_dict(state_dict_model, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    mine_optimizer = torch.optim.AdamW(inner_model.parameters(), lr=2e-5, weight_decay=0.04)
    mine_optimizer.load_state_dict(torch.load(os.path.join(out, "optimizer.ckpt"), map_location="cpu"))

    for name, value in inner_model.state_dict().items():
        if not name.startswith("value_head.normalizer."):
            torch.testing.assert_close(value, policy.state_dict()[f"mine.{name}"])
    assert float(inner_model.value_head.normalizer.running_mean) == 0.25
    by_name = dict(inner_model.named_parameters())
    for i, name in enumerate(n for n, p in policy.named_parameters() if p.requires_grad):
        torch.testing.assert_close(mine_optimizer.state[by_name[name.removeprefix("mine.")]]["exp_avg"],
                                   optimizer.state_dict()["state"][i]["exp_avg"])
    _step(inner_model, mine_optimizer)  # and it trains on from there
