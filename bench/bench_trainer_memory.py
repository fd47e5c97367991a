"""Trainer memory against batch size, with MineStudio's real VPT-2x architecture (random weights).

One trainer rank runs whole PPO iterations (value and log-prob recomputation, GAE, the update over
context windows with the KL term to a frozen reference, as in MineStudio's quick start) on batches
of 1, 2, 4, 8 chains of 128x128 frames, and records the peak memory of each: RSS on the CPU (the
high-water mark, reset before each iteration through /proc/self/clear_refs), max_memory_allocated on
a GPU. Beside it, in the same process, the value recomputation as it was before (the whole batch
through the model in one pass).

Each row gives the memory held before (model, optimizer, reference, and the batch itself, which
lives in host memory: ~8.4 MB of recurrent state and 49 KB per frame for VPT-2x) and the peak above
it: the trainer's working memory, which must not grow with the batch.

VPT needs MineStudio, which has its own venv (`make test-minestudio` builds .venv-minestudio; or
BENCH_MINESTUDIO_PYTHON names its python): run from any other Python, this script runs itself there.
Writes bench/results/trainer_memory.json.

    python -m bench.bench_trainer_memory [--chains 1,2,4,8] [--steps 8] [--context 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.runs, when run as a script
from bench.runs import provenance  # noqa: E402

RESULT = ROOT / "bench" / "results" / "trainer_memory.json"
MINESTUDIO_PYTHON = Path(os.environ.get("BENCH_MINESTUDIO_PYTHON", ROOT / ".venv-minestudio" / "bin" / "python"))

# MineStudio's foundation-model-2x (OpenAI VPT 2x): 248.5 M parameters, 8.4 MB of transformer memory.
VPT_2X = {"attention_heads": 16, "attention_mask_style": "clipped_causal", "attention_memory_size": 256,
          "diff_mlp_embedding": False, "hidsize": 2048, "img_shape": [128, 128, 3], "impala_chans": [16, 32, 32],
          "impala_kwargs": {"post_pool_groups": 1}, "impala_width": 8,
          "init_norm_kwargs": {"batch_norm": False, "group_norm_groups": 1}, "n_recurrence_layers": 4,
          "only_img_input": True, "pointwise_ratio": 4, "pointwise_use_activation": False,
          "recurrence_is_residual": True, "recurrence_type": "transformer", "timesteps": 128,
          "use_pointwise_layer": True, "use_pre_lstm_ln": False}
ACTIONS = {"buttons": 8641, "camera": 121}


def in_minestudio_venv() -> bool:
    try:
        import minestudio  # noqa: F401
    except ImportError:
        return False
    return True


# glibc serves large blocks from mmap only up to a threshold that grows as blocks are freed; then freed
# tensors stay resident and RSS stops following live memory. A fixed threshold keeps every tensor
# mmapped, so the peak RSS is the peak of live memory.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def rerun(python: Path) -> int:
    if not python.exists():
        print(f"{python} is missing: `make test-minestudio` builds MineStudio's venv", file=sys.stderr)
        return 1
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT)])}
    return subprocess.call([str(python), "-m", "bench.bench_trainer_memory", *sys.argv[1:]], cwd=ROOT, env=env)


def rss_mb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def peak_mb(device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    return rss_mb("VmHWM")


def current_mb(device: Any) -> float:
    import torch

    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else rss_mb()


class LocalGae:
    """The gae service's computation, in process (this bench measures the trainer, not the wire)."""

    def estimate(self, request: dict, discount: float, gae_lambda: float, vtrace: bool = False,
                 rho_clip: float = 1.0, c_clip: float = 1.0) -> tuple[Any, Any]:
        from overworld.gae.advantage import gae

        return gae(**request, discount=discount, gae_lambda=gae_lambda)


def make_trainer(steps: int, context: int, device: Any, use_amp: bool) -> Any:
    import gymnasium as gym
    import torch
    from minestudio.models import VPTPolicy

    from overworld.core.config import load_config
    from overworld.online import PPOTrainer
    from overworld.policies.minestudio import as_policy

    class VPTTrainer(PPOTrainer):
        def build_policy(self) -> Any:
            torch.manual_seed(0)
            space = gym.spaces.Dict({k: gym.spaces.Discrete(n) for k, n in ACTIONS.items()})
            return as_policy(VPTPolicy(policy_kwargs=VPT_2X), space)

    # MineStudio's quick-start train_config, with this bench's fragment and window lengths.
    config = load_config(ROOT / "examples" / "minecraft_kill_cow.py", [
        "train_config.num_workers=1", f"train_config.context_length={context}", f"train_config.use_amp={use_amp}",
        f"rollout_config.fragment_length={steps}", "train_config.save_interval=0"])
    trainer = VPTTrainer.from_config(config, rollout_manager="")
    trainer.device = device
    trainer.model, trainer.optimizer = trainer.setup_model_and_optimizer()
    trainer.gae_client = LocalGae()
    return trainer


def make_batch(trainer: Any, chains: int, steps: int) -> Any:
    import torch

    from overworld.trainer.data import Batch

    g = torch.Generator().manual_seed(chains)
    policy = trainer.unwrapped_model
    first = torch.zeros(chains, steps, dtype=torch.bool)
    first[:, 0] = True
    zeros = torch.zeros(chains, steps)
    return Batch(
        obs={"image": torch.randint(0, 256, (chains, steps, 128, 128, 3), dtype=torch.uint8, generator=g)},
        next_obs={"image": torch.randint(0, 256, (chains, 1, 128, 128, 3), dtype=torch.uint8, generator=g)},
        action={k: torch.randint(0, n, (chains, steps), generator=g) for k, n in ACTIONS.items()},
        state={k: v.cpu() for k, v in policy.initial_state(chains).items()},
        reward=(torch.rand(chains, steps, generator=g) < 0.05).float(),
        terminated=torch.zeros(chains, steps, dtype=torch.bool), truncated=torch.zeros(chains, steps, dtype=torch.bool),
        first=first, behaviour_logp=torch.full((chains, steps), -9.0), behaviour_value=zeros, bootstrap_value=zeros,
        model_version=torch.ones(chains, steps, dtype=torch.int64))


def batch_mb(batch: Any) -> float:
    tensors = [*batch.obs.values(), *batch.next_obs.values(), *batch.action.values(), *batch.state.values()]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def one_iteration(trainer: Any, chains: int, steps: int) -> dict[str, float]:
    """A whole iteration on `chains` chains: MineStudio's quick start with batch_size_per_gpu 1, one
    optimizer step (gradient accumulation over every minibatch)."""
    t = trainer.config.train_config
    t.batch_size_per_gpu, t.batches_per_iteration, t.gradient_accumulation = 1, chains, chains
    batch = make_batch(trainer, chains, steps)
    reset_peak(trainer.device)
    before = current_mb(trainer.device)
    started = time.monotonic()
    trainer.iteration += 1
    trainer.estimate_advantages(batch)
    trainer.train_iteration(batch)
    seconds = time.monotonic() - started
    peak = peak_mb(trainer.device)
    return {"chains": chains, "steps": steps, "batch_mb": round(batch_mb(batch), 1), "before_mb": round(before, 1),
            "peak_mb": round(peak, 1), "peak_above_before_mb": round(peak - before, 1), "seconds": round(seconds, 1),
            "samples_per_second": round(chains * steps / seconds, 2)}


def whole_batch_recomputation(trainer: Any, chains: int, steps: int) -> dict[str, float]:
    """The value recomputation as before this change: every chain and every step in one forward."""
    batch = make_batch(trainer, chains, steps)
    saved = trainer.inference_batch_size_per_gpu, trainer.context_length
    trainer.inference_batch_size_per_gpu, trainer.context_length = chains, steps
    try:
        reset_peak(trainer.device)
        before = current_mb(trainer.device)
        trainer.compute_values(batch)
        return recomputation_row(trainer, batch, before)
    finally:
        trainer.inference_batch_size_per_gpu, trainer.context_length = saved


def chunked_recomputation(trainer: Any, chains: int, steps: int) -> dict[str, float]:
    batch = make_batch(trainer, chains, steps)
    reset_peak(trainer.device)
    before = current_mb(trainer.device)
    trainer.compute_values(batch)
    return recomputation_row(trainer, batch, before)


def recomputation_row(trainer: Any, batch: Any, before: float) -> dict[str, float]:
    peak = peak_mb(trainer.device)
    return {"chains": batch.size, "steps": batch.length, "batch_mb": round(batch_mb(batch), 1),
            "before_mb": round(before, 1), "peak_mb": round(peak, 1), "peak_above_before_mb": round(peak - before, 1)}


def growth(rows: list[dict[str, float]]) -> float:
    """MB of peak above the memory held before the iteration, per extra chain, between the smallest and
    the largest batch (the batch itself is made before: its bytes are not in it)."""
    lo, hi = rows[0], rows[-1]
    return round((hi["peak_above_before_mb"] - lo["peak_above_before_mb"]) / (hi["chains"] - lo["chains"]), 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=8, help="steps per chain (fragment_length)")
    parser.add_argument("--context", type=int, default=4, help="context_length")
    args = parser.parse_args()
    if not in_minestudio_venv():
        return rerun(MINESTUDIO_PYTHON)
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        return rerun(Path(sys.executable))
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [int(c) for c in args.chains.split(",")]
    started = time.monotonic()
    trainer = make_trainer(args.steps, args.context, device, use_amp=device.type == "cuda")
    params = sum(p.numel() for p in trainer.unwrapped_model.parameters())
    print(f"VPT-2x built ({params / 1e6:.1f} M parameters) on {device} in {time.monotonic() - started:.0f}s",
          flush=True)
    one_iteration(trainer, sizes[0], args.steps)  # the optimizer's state exists from here on
    rows: dict[str, list[dict[str, float]]] = {"iteration": [], "recomputation_chunked": [],
                                               "recomputation_whole_batch_before": []}
    for chains in sizes:
        rows["iteration"].append(one_iteration(trainer, chains, args.steps))
        print("iteration", rows["iteration"][-1], flush=True)
    for chains in sizes:
        rows["recomputation_chunked"].append(chunked_recomputation(trainer, chains, args.steps))
        rows["recomputation_whole_batch_before"].append(whole_batch_recomputation(trainer, chains, args.steps))
        print("recomputation", rows["recomputation_chunked"][-1], rows["recomputation_whole_batch_before"][-1],
              flush=True)
    t = trainer.config.train_config
    result = {
        "model": f"MineStudio VPTPolicy, foundation-model-2x architecture, random weights ({params / 1e6:.1f} M)",
        "device": str(device), "memory": "max_memory_allocated" if device.type == "cuda" else "peak RSS (VmHWM)",
        "settings": {"steps_per_chain": args.steps, "context_length": t.context_length, "batch_size_per_gpu": 1,
                     "inference_batch_size_per_gpu": trainer.inference_batch_size_per_gpu,
                     "kl_divergence_coef_rho": t.kl_divergence_coef_rho, "use_amp": t.use_amp,
                     "image": "128x128x3 uint8"},
        "rows": rows,
        "peak_growth_mb_per_chain": {k: growth(v) for k, v in rows.items()},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({**provenance(), **result}, indent=2) + "\n")
    print(json.dumps(result["peak_growth_mb_per_chain"]), f"-> {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
