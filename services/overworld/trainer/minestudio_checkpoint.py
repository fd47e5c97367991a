"""Checkpoints both ways between Overworld and MineStudio's PPOTrainer.

MineStudio writes `checkpoints/<time>/<n>/` with `model.ckpt` (the MinePolicy's state_dict),
`optimizer.ckpt` (AdamW over `model.parameters()`, indexed in that order), `scaler.ckpt` (AMP) and
`whole_config.pkl`. MineStudio resumes by reading model.ckpt (`strict=False`) and optimizer.ckpt with
torch's full, pickle-based loader; Overworld never does (below), and never reads whole_config.pkl.

- import: `train_config.resume: <such a directory>` loads model.ckpt, optimizer.ckpt and scaler.ckpt
  with `torch.load(weights_only=True)` (tensors and plain containers: nothing in them runs);
- export: `overworld export-minestudio <overworld checkpoint dir> <out dir>` (or `export_checkpoint`)
  writes the three files MineStudio's PPOTrainer resumes from (`resume: <out dir>`).

The optimizer state is matched by parameter name: MineStudio's AdamW also counts the value
normaliser's statistics (parameters with requires_grad=False), Overworld's optimizer does not. The
value normaliser's statistics travel between VPT's `value_head.normalizer` and Overworld's
`value_normalizer`.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overworld.trainer.checkpoint import tensors_from_bytes

log = logging.getLogger("overworld.trainer.minestudio_checkpoint")

MODEL, OPTIMIZER, SCALER, WHOLE_CONFIG = "model.ckpt", "optimizer.ckpt", "scaler.ckpt", "whole_config.pkl"
NORMALIZER = {"mean": "running_mean", "mean_sq": "running_mean_sq", "debias": "debiasing_term"}


def is_minestudio_checkpoint(path: str | None) -> bool:
    return bool(path) and Path(str(path), MODEL).is_file()


def load_weights_only(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _mine(policy: nn.Module) -> nn.Module:
    """The MinePolicy inside an adapter, or the module itself."""
    return getattr(policy, "mine", policy)


def _normalizer(mine: nn.Module) -> nn.Module | None:
    return getattr(getattr(mine, "value_head", None), "normalizer", None)


def _trainable_names(policy: nn.Module) -> list[str]:
    return [name for name, p in policy.named_parameters() if p.requires_grad]


def _reindex(state: dict[str, Any], from_names: list[str], to_names: list[str]) -> dict[str, Any]:
    """An optimizer state_dict over parameters `from_names` (in that order) as one over `to_names`."""
    where = {name: i for i, name in enumerate(to_names)}
    per_param = {where[from_names[i]]: s for i, s in state["state"].items() if from_names[int(i)] in where}
    groups = [{**g, "params": list(range(len(to_names)))} for g in state["param_groups"][:1]]
    if len(state["param_groups"]) != 1:
        raise ValueError("only single-group optimizers (MineStudio's AdamW) can be converted")
    return {"state": per_param, "param_groups": groups}


def import_checkpoint(directory: str, policy: nn.Module, optimizer: torch.optim.Optimizer | None,
                      scaler: Any = None) -> dict[str, int]:
    """Load a MineStudio checkpoint directory into `policy` (an overworld Policy wrapping a MinePolicy,
    or the MinePolicy), and `optimizer`/`scaler` when given. Returns counts of what was loaded."""
    path = Path(directory)
    mine = _mine(policy)
    weights = load_weights_only(path / MODEL)
    result = mine.load_state_dict(weights, strict=False)  # strict=False as MineStudio's resume
    if result.missing_keys or result.unexpected_keys:
        log.warning("%s: %d parameters missing from the checkpoint, %d unknown to the policy (first: %s)",
                    path / MODEL, len(result.missing_keys), len(result.unexpected_keys),
                    (result.missing_keys + result.unexpected_keys)[:3])
    normalizer, ours = _normalizer(mine), getattr(policy, "value_normalizer", None)
    if normalizer is not None and ours is not None:
        with torch.no_grad():
            for mine_name, ms_name in NORMALIZER.items():
                getattr(ours, mine_name).copy_(getattr(normalizer, ms_name).reshape(-1)[0])
    loaded = {"tensors": len(weights) - len(result.unexpected_keys), "optimizer_states": 0}
    if optimizer is not None and (path / OPTIMIZER).is_file():
        ms_names = [name for name, _ in mine.named_parameters()]
        prefix = "mine." if mine is not policy else ""
        ours_names = [n.removeprefix(prefix) for n in _trainable_names(policy)]
        state = _reindex(load_weights_only(path / OPTIMIZER), ms_names, ours_names)
        optimizer.load_state_dict(state)
        loaded["optimizer_states"] = len(state["state"])
    if scaler is not None and (path / SCALER).is_file():
        scaler.load_state_dict(load_weights_only(path / SCALER))
    log.info("resumed from MineStudio checkpoint %s: %s", path, loaded)
    return loaded


def minestudio_files(policy: nn.Module, optimizer_state: dict[str, Any] | None, scaler_state: dict | None,
                     whole_config: str) -> dict[str, bytes]:
    """The files of a MineStudio checkpoint directory for this policy and optimizer state."""
    mine = _mine(policy)
    weights = {k: v.detach().cpu().clone() for k, v in mine.state_dict().items()}
    normalizer, ours = _normalizer(mine), getattr(policy, "value_normalizer", None)
    if normalizer is not None and ours is not None:
        for ours_name, ms_name in NORMALIZER.items():
            key = f"value_head.normalizer.{ms_name}"
            weights[key] = getattr(ours, ours_name).detach().cpu().reshape(weights[key].shape).clone()
    files = {MODEL: _save(weights), WHOLE_CONFIG: pickle.dumps(whole_config)}
    if optimizer_state is not None:
        prefix = "mine." if mine is not policy else ""
        ours_names = [n.removeprefix(prefix) for n in _trainable_names(policy)]
        files[OPTIMIZER] = _save(_reindex(optimizer_state, ours_names, [n for n, _ in mine.named_parameters()]))
    if scaler_state:
        files[SCALER] = _save(scaler_state)
    return files


def _save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def export_checkpoint(checkpoint_dir: str, out_dir: str) -> Path:
    """An Overworld checkpoint directory (`<save_path>/<run_id>/checkpoints/iter-N`, local) as a
    MineStudio one: builds the run's policy from the config saved in the checkpoint, loads the
    weights and optimizer state, writes model.ckpt, optimizer.ckpt (scaler.ckpt) and whole_config.pkl."""
    from overworld.core.config import load_config, to_yaml
    from overworld.core.wire.weights import from_bytes
    from overworld.policies.factory import run_spaces

    src = Path(checkpoint_dir)
    if not (src / "COMMITTED").exists():
        raise ValueError(f"{src} is not a committed Overworld checkpoint (no COMMITTED file)")
    state = json.loads((src / "state.json").read_text())
    config = load_config(state["config"])
    _, policy, _, _ = run_spaces(config)
    policy.load_state_dict(from_bytes((src / "model.safetensors").read_bytes(), policy.state_dict()))
    optimizer_state = tensors_from_bytes((src / "optimizer.pt").read_bytes()) if (src / "optimizer.pt").exists() else None
    scaler_state = tensors_from_bytes((src / "scaler.pt").read_bytes()) if (src / "scaler.pt").exists() else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in minestudio_files(policy, optimizer_state, scaler_state, to_yaml(config)).items():
        (out / name).write_bytes(data)
    return out
