"""`make gpu-check` (bench/gpu/check.py) cannot rot: its CPU dry run runs every step here, on a Python where
every package the GPU box lacks is hidden (bench/gpu/box.py), resumes a Crafter seed from its checkpoint
across segments and across commands, and writes its results and report rows. Also: the VPT-2x stand-in
has VPT-2x's size and behaves as a recurrent policy must, and the wheel set is pinned as the project is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from bench.gpu import box
from bench.gpu.vpt_standin import TINY, VPT_2X, VPTStandIn, count_parameters

ROOT = Path(__file__).resolve().parents[2]
# MineStudio's VPTPolicy with the foundation-model-2x kwargs (bench/bench_trainer_memory.py's VPT_2X),
# built from MineStudio's code (commit f6a1c23) on the meta device: 248,495,294 parameters, 3 of them the
# value normaliser's frozen statistics (Overworld keeps those as buffers).
VPT_2X_TRAINABLE = 248_495_291


def test_the_standin_has_vpt_2x_size_and_memory() -> None:
    assert count_parameters(VPT_2X) == VPT_2X_TRAINABLE
    with torch.device("meta"):
        state = VPTStandIn(VPT_2X).initial_state(1)
    floats = sum(v.numel() * v.element_size() for k, v in state.items() if k != "valid")
    assert floats == 4 * 2 * 128 * 2048 * 4  # VPT-2x's transformer memory per env: 8.4 MB


def test_the_standin_is_a_recurrent_policy_with_episode_resets() -> None:
    """Windows with the memory carried give what one pass gives; an episode start forgets the past."""
    torch.manual_seed(0)
    policy = VPTStandIn(TINY).eval()
    B, T = 2, 12
    image = torch.randint(0, 256, (B, T, TINY.image, TINY.image, 3), dtype=torch.uint8)
    first = torch.zeros(B, T, dtype=torch.bool)
    first[:, 0] = True
    first[1, 7] = True
    with torch.no_grad():
        whole, _ = policy({"image": image}, policy.initial_state(B), first)
        state, parts = policy.initial_state(B), []
        for start in range(0, T, 4):
            out, state = policy({"image": image[:, start:start + 4]}, state, first[:, start:start + 4])
            parts.append(out.vpred)
        fresh, _ = policy({"image": image[1:, 7:]}, policy.initial_state(1), first[1:, 7:])
    torch.testing.assert_close(torch.cat(parts, 1), whole.vpred, rtol=0, atol=1e-5)
    torch.testing.assert_close(fresh.vpred, whole.vpred[1:, 7:], rtol=0, atol=1e-5)
    assert not torch.allclose(whole.vpred[1, 3:7], fresh.vpred[0, :4])  # the memory mattered before the start


def test_the_wheel_set_is_pinned_as_the_project_is() -> None:
    """Every wheel pinned, at the version this venv runs (the dry run simulates the box with these), and
    pyproject.toml's own pins kept."""
    wheels = box.wheel_requirements()
    assert wheels and all(wheels.values())
    for name, version in wheels.items():
        assert metadata.version(name) == version, name
    pyproject = (ROOT / "pyproject.toml").read_text()
    for needed in ("omegaconf", "crafter", "gymnasium", "grpcio", "protobuf", "cryptography"):
        assert f'"{needed}=={wheels[needed]}"' in pyproject


def test_make_runs_the_dry_check() -> None:
    # --no-print-directory: under a parent make (CI's `make test`) the last line would be "Leaving directory"
    out = subprocess.run(["make", "-n", "--no-print-directory", "gpu-check", "DRY=1", "GPU_CHECK_ARGS=--budget 1"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "-m bench.gpu.check --dry --budget 1" in out.splitlines()[-1]


def check(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu.check", "--dry", "--state", str(state), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if not k.startswith("OVERWORLD_GPU_CHECK")})


@pytest.mark.slow
def test_the_dry_run_does_every_step_without_the_packages_the_box_lacks(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = check(state)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    hidden = json.loads((state / "box" / "hidden.json").read_text())
    assert {"ray", "wandb", "tensorboard", "numba", "hypothesis"} <= set(hidden)
    result = json.loads((state / "gpu.json").read_text())
    assert result["dry_run"] is True and (ROOT / "bench" / "results" / "gpu.json").exists() is not None
    for step in ("rollout", "vpt2x", "amp_fp16", "crafter"):
        assert result[step]["on"]["torch"] == torch.__version__, step
    rollout = result["rollout"]
    assert set(rollout["rows"]) == {"cuda", "cpu"}
    assert all(row["env_steps"] > 0 and row["mean_inference_batch"] > 0 for row in rollout["rows"].values())
    vpt = result["vpt2x"]
    assert vpt["parameters_vpt_2x"] == VPT_2X_TRAINABLE and vpt["losses_finite"] and vpt["optimizer_steps"] >= 1
    assert vpt["settings"]["autocast"] == "torch.bfloat16" and vpt["settings"]["reference_policy"]
    amp = result["amp_fp16"]
    assert amp["forward_dtypes"] == ["torch.float16"] and amp["grad_scaler"] == "GradScaler"
    assert amp["scaler_restored"] and amp["weights_changed"] and amp["weights_finite"]
    seed = result["crafter"]["seeds"]["0"]
    assert seed["done"] and seed["env_steps"] >= 2048 and len(seed["segments"]) == 2
    assert seed["segments"][0]["resumed_from"] is None and seed["segments"][1]["resumed_from"]  # from its checkpoint
    assert seed["segments"][1]["start_env_steps"] >= 1024
    assert seed["crafter"]["episodes"] == sum(s["episodes_scored"] for s in seed["segments"]) > 0
    assert result["crafter"]["score_per_finished_seed"]["0"] == seed["crafter"]["score"]
    report = (state / "REPORT.md").read_text()
    assert "rollout worker" in report and "VPT-2x stand-in" in report and "seed 0: score after" in report

    # Another command: what is done stays done. A new seed of 100k env steps, each segment stopped by the
    # clock (as a command's end stops it) and the command ending after two: not finished (exit 75), and
    # the second segment went on from the checkpoint the first one wrote when it was stopped.
    second = check(state, "--seeds", "0,1", "--crafter-steps", "100000", "--segment-steps", "100000",
                   "--segment-seconds", "25", "--max-segments", "2")
    assert second.returncode == 75, second.stdout[-4000:] + second.stderr[-4000:]
    assert "== rollout" not in second.stdout and "== vpt2x" not in second.stdout and "not finished" in second.stdout
    again = json.loads((state / "gpu.json").read_text())
    assert again["crafter"]["seeds"]["0"]["segments"] == seed["segments"]
    stopped, resumed = again["crafter"]["seeds"]["1"]["segments"]
    assert (stopped["status"], resumed["status"]) == ("interrupted", "interrupted")
    # (the summary's latest checkpoint is the last one the launcher saw; the trainer writes one more as it stops)
    assert stopped["latest_checkpoint"] and resumed["resumed_from"] >= stopped["latest_checkpoint"]
    assert resumed["start_env_steps"] > 0 and resumed["env_steps"] > resumed["start_env_steps"]
    assert not again["crafter"]["seeds"]["1"]["done"]
