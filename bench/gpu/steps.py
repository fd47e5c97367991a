"""The GPU check's measuring steps, each run by bench/gpu/check.py in a child process:

    python -m bench.gpu.steps rollout|vpt2x|amp_fp16 --result PATH

rollout   a rollout worker (bench/bench_rollout_worker.py's WorkerBench: in-process manager, buffer and
          registry; nothing trains) with examples/crafter_resnet.yaml's ResNet, 16 Crafter envs in groups
          of 8 over 8 env processes, inference on CUDA, then on the CPU with the cores the envs leave;
vpt2x     one PPO iteration of the VPT-2x stand-in (bench/gpu/vpt_standin.py: MineStudio cannot be on the
          box) at MineStudio's quick-start batch per GPU (examples/minecraft_kill_cow.py: 200 chains x 256
          steps, context 64, gradient accumulation 10, KL to a frozen reference) under bf16 autocast,
          after a 2-chain warm-up;
amp_fp16  `use_amp` with `amp_dtype: float16` (MineStudio's fp16 + GradScaler): two updates of the Crafter
          ResNet, then a checkpoint and a resume that must restore the scaler.

Each writes its figures to PATH as soon as it has some ("complete": true at the end), with the device,
driver, torch and Python beside them. On the stand-in box (GPU_CHECK_STAND_IN=1) every step runs on the
CPU at tiny sizes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.outbox import write_json
from bench.gpu.plan import ROOT, WORKDIR, stand_in
from bench.gpu.probe import device_stamp

CRAFTER_CONFIG = "examples/crafter_resnet.yaml"
TINY_RESNET = ["policy_kwargs.channels=[8,16,16]", "policy_kwargs.dense=32", "policy_kwargs.hidden=64"]
TINY_VPT_RUN = ["rollout_config.fragment_length=8", "train_config.context_length=4",
                "train_config.batches_per_iteration=2", "train_config.gradient_accumulation=2"]

Report = Callable[[dict[str, Any]], None]
FIRST_CHAINS = 20  # vpt2x: the batch measured before the whole one


def compute_device() -> Any:
    import torch

    return torch.device("cpu") if stand_in() else torch.device("cuda", 0)


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: Any) -> dict[str, float]:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {"max_memory_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
                "max_memory_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)}
    rss = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return {"peak_rss_gib": round(rss / 2**20, 2)}


# -- rollout: inference on CUDA vs the CPU -----------------------------------------------------------------
def rollout(workdir: Path, report: Report, until: float) -> dict[str, Any]:
    from bench.bench_rollout_worker import WorkerBench

    cpus = os.cpu_count() or 2
    tiny = stand_in()
    envs, batch, procs, seconds = (4, 2, 2, 2.0) if tiny else (16, 8, min(8, max(2, cpus // 2)), 20.0)
    out: dict[str, Any] = {"config": CRAFTER_CONFIG, "num_envs": envs, "batch_size": batch, "env_processes": procs,
                           "seconds_per_row": seconds, "rows": {},
                           "policy": "the recipe's IMPALA ResNet (3.9 M parameters, ~0.46 GFLOP/frame)"}
    for name, device in (("cuda", "cpu" if tiny else "cuda"), ("cpu", "cpu")):
        # the CPU row's inference gets the cores the env processes leave (the CUDA row needs one)
        threads = 1 if name == "cuda" or tiny else max(1, cpus - procs)
        bench = WorkerBench(None, envs, workdir / name, batch_size=batch, config_path=CRAFTER_CONFIG, overrides=(
            f"rollout_config.worker_config.device={device}", f"rollout_config.worker_config.num_env_processes={procs}",
            f"rollout_config.num_cpus_per_worker={threads}"))
        try:
            out["rows"][name] = {**bench.measure(seconds), "inference_device": device, "inference_threads": threads}
        finally:
            bench.close()
        print(f"rollout {name}: {out['rows'][name]['env_steps_per_second']:.0f} env steps/s", flush=True)
        report(out)
    rows = out["rows"]
    out["cuda_over_cpu"] = round(rows["cuda"]["env_steps_per_second"] / max(rows["cpu"]["env_steps_per_second"], 1e-9), 2)
    return out


# -- a synthetic batch ---------------------------------------------------------------------------------------
def synthetic_batch(policy: Any, key: str, frame: tuple[int, ...], actions: dict[str, int], chains: int,
                    steps: int, seed: int) -> Any:
    import torch

    from overworld.trainer.data import Batch

    g = torch.Generator().manual_seed(seed)
    first = torch.zeros(chains, steps, dtype=torch.bool)
    first[:, 0] = True
    zeros = torch.zeros(chains, steps)
    return Batch(
        obs={key: torch.randint(0, 256, (chains, steps, *frame), dtype=torch.uint8, generator=g)},
        next_obs={key: torch.randint(0, 256, (chains, 1, *frame), dtype=torch.uint8, generator=g)},
        action={k: torch.randint(0, n, (chains, steps), generator=g) for k, n in actions.items()},
        # built on the host: chains x 8.4 MB for VPT-2x must not count in the device's peak
        state={k: v.cpu().expand(chains, *v.shape[1:]).clone() for k, v in policy.initial_state(1).items()},
        reward=(torch.rand(chains, steps, generator=g) < 0.05).float(),
        terminated=torch.zeros(chains, steps, dtype=torch.bool), truncated=torch.zeros(chains, steps, dtype=torch.bool),
        first=first, behaviour_logp=torch.full((chains, steps), -2.0), behaviour_value=zeros.clone(),
        bootstrap_value=zeros.clone(), model_version=torch.ones(chains, steps, dtype=torch.int64))


class LocalGae:
    """The gae service's computation in this process (the step measures the trainer, not the wire)."""

    def estimate(self, request: dict, discount: float, gae_lambda: float, vtrace: bool = False,
                 rho_clip: float = 1.0, c_clip: float = 1.0) -> tuple[Any, Any]:
        from overworld.gae.advantage import gae

        return gae(**request, discount=discount, gae_lambda=gae_lambda)


# -- vpt2x: one PPO iteration of VPT-2x's size under bf16 autocast ---------------------------------------------
def vpt2x(workdir: Path, report: Report, until: float) -> dict[str, Any]:
    import torch

    from bench.gpu.vpt_standin import TINY, VPT_2X, VPTStandIn, count_parameters
    from overworld.core.config import load_config
    from overworld.online import PPOTrainer

    tiny = stand_in()
    shape = TINY if tiny else VPT_2X
    device = compute_device()

    class VPTTrainer(PPOTrainer):
        def build_policy(self) -> Any:
            policy = VPTStandIn(shape)
            policy.value_normalizer.enabled = self.config.train_config.use_normalized_vf
            return policy

    # MineStudio's quick start, per GPU: batch_size_per_gpu 1 x batches_per_iteration 200 chains of 256 steps
    config = load_config(ROOT / "examples" / "minecraft_kill_cow.py", [
        "train_config.use_amp=true", "train_config.amp_dtype=bfloat16", "train_config.save_interval=0",
        *(TINY_VPT_RUN if tiny else [])])
    t = config.train_config
    began = time.monotonic()
    torch.manual_seed(0)
    trainer = VPTTrainer.from_config(config, rollout_manager="")
    trainer.device = device
    trainer.model, trainer.optimizer = trainer.setup_model_and_optimizer()
    trainer.gae_client = LocalGae()
    policy = trainer.unwrapped_model
    chains, steps = t.batch_size_per_gpu * t.batches_per_iteration, config.rollout_config.fragment_length
    frame, actions = (shape.image, shape.image, 3), dict(shape.actions)
    accumulation = t.gradient_accumulation
    out: dict[str, Any] = {
        "model": "the VPT stand-in at a tiny width (stand-in box)" if tiny else
                 "VPT-2x stand-in (bench/gpu/vpt_standin.py): VPT-2x's layers and widths, MineStudio not on the box",
        "parameters": sum(p.numel() for p in policy.parameters()), "parameters_vpt_2x": count_parameters(VPT_2X),
        "seconds_to_build": round(time.monotonic() - began, 1),
        "settings": {"chains": chains, "steps_per_chain": steps, "context_length": t.context_length,
                     "batch_size_per_gpu": t.batch_size_per_gpu, "gradient_accumulation": accumulation,
                     "epochs_per_iteration": t.epochs_per_iteration,
                     "kl_divergence_coef_rho": t.kl_divergence_coef_rho, "reference_policy": trainer.reference is not None,
                     "inference_batch_size_per_gpu": trainer.inference_batch_size_per_gpu,
                     "autocast": str(trainer.amp_dtype), "grad_scaler": trainer.scaler is not None,
                     "source": "examples/minecraft_kill_cow.py (MineStudio's quick start), one GPU's share"}}

    def iteration(n: int, seed: int) -> tuple[float, dict[str, float]]:
        batch = synthetic_batch(policy, "image", frame, actions, n, steps, seed)
        t.batches_per_iteration = n // t.batch_size_per_gpu
        t.gradient_accumulation = min(accumulation, t.batches_per_iteration)
        synchronize(device)
        started = time.monotonic()
        trainer.iteration += 1
        trainer.estimate_advantages(batch)
        metrics = trainer.train_iteration(batch) or {}
        synchronize(device)
        return time.monotonic() - started, metrics

    warm_chains = min(chains, 2 * t.batch_size_per_gpu)
    warm_seconds, _ = iteration(warm_chains, 1)  # kernels chosen, the optimizer's state allocated
    per_sample = warm_seconds / (warm_chains * steps)
    out.update(warmup={"chains": warm_chains, "seconds": round(warm_seconds, 2)}, iterations=[])
    report(out)
    # a tenth of the batch first: if the whole one would not fit the step's time, that figure still stands
    for n in sorted({min(chains, FIRST_CHAINS * t.batch_size_per_gpu), chains}):
        projected = per_sample * n * steps
        if time.time() + projected > until - 10.0:
            out["not_measured"] = {"chains": n, "projected_seconds": round(projected, 1)}
            break
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds, metrics = iteration(n, 2)
        per_sample = seconds / (n * steps)
        out["iterations"].append({
            "chains": n, "samples": n * steps, "seconds": round(seconds, 2),
            "samples_per_second": round(n * steps / seconds, 1), "optimizer_steps": trainer.updates,
            "skipped_steps": metrics.get("trainer/skipped_steps"),
            "parts_seconds": {**{k: round(v, 2) for k, v in trainer.timings.items()},
                              "update": round(seconds - sum(trainer.timings.get(k, 0.0) for k in ("values", "gae")), 2)},
            "losses_finite": all(v == v and abs(v) != float("inf") for k, v in metrics.items() if k.endswith("_loss")),
            **peak_memory(device)})
        out.update({k: out["iterations"][-1][k] for k in ("samples_per_second", "losses_finite")},
                   iteration_seconds=out["iterations"][-1]["seconds"], chains_measured=n,
                   **peak_memory(device))
        report(out)
    return out


# -- amp_fp16: fp16 autocast with a GradScaler, through a checkpoint ----------------------------------------
def amp_fp16(workdir: Path, report: Report, until: float) -> dict[str, Any]:
    import torch

    from overworld.core.config import load_config
    from overworld.online import PPOTrainer
    from overworld.trainer.checkpoint import checkpoint_store

    device = compute_device()
    steps = 16 if stand_in() else 64  # fp16 on the CPU is emulated: slow
    overrides = ["train_config.use_amp=true", "train_config.amp_dtype=float16", "run_id=amp-fp16",
                 "train_config.batch_size_per_gpu=2", "train_config.batches_per_iteration=2",
                 f"train_config.context_length={steps}", *(TINY_RESNET if stand_in() else [])]

    def trainer(*extra: str) -> PPOTrainer:
        config = load_config(ROOT / CRAFTER_CONFIG, [*overrides, *extra])
        torch.manual_seed(0)
        tr = PPOTrainer.from_config(config, rollout_manager="", workdir=str(workdir))
        tr.device = device
        tr.model, tr.optimizer = tr.setup_model_and_optimizer()
        tr.lr_schedule = tr.setup_lr_schedule(tr.optimizer)
        tr.checkpoints = checkpoint_store(tr.config, tr.workdir)
        return tr

    first = trainer()
    batch = synthetic_batch(first.unwrapped_model, "obs", (64, 64, 3), {"action": 17}, 4, steps, 3)
    batch.advantage, batch.value_target = torch.randn(4, steps), torch.randn(4, steps)
    batch.old_vpred = torch.zeros(4, steps)
    seen: list[str] = []
    first.unwrapped_model.encoder[0][0].conv.layer.register_forward_hook(lambda _m, _i, out: seen.append(str(out.dtype)))
    before = torch.cat([p.detach().flatten().float().cpu() for p in first.unwrapped_model.parameters()])
    metrics = first.update(batch)
    after = torch.cat([p.detach().flatten().float().cpu() for p in first.unwrapped_model.parameters()])
    first.iteration = 1
    checkpoint = first.save_checkpoint()
    resumed = trainer("train_config.resume=latest")
    resumed.restore()
    return {"autocast": str(first.amp_dtype), "forward_dtypes": sorted(set(seen)),
            "grad_scaler": type(first.scaler).__name__ if first.scaler is not None else None,
            "scale_after_update": first.scaler.get_scale() if first.scaler is not None else None,
            "optimizer_steps": first.updates, "skipped_steps": metrics["trainer/skipped_steps"],
            "weights_changed": bool(not torch.equal(before, after)), "weights_finite": bool(torch.isfinite(after).all()),
            "checkpoint": checkpoint, "scaler_restored": resumed.scaler is not None and first.scaler is not None
            and resumed.scaler.state_dict() == first.scaler.state_dict()}


STEP_FUNCTIONS = {"rollout": rollout, "vpt2x": vpt2x, "amp_fp16": amp_fp16}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=sorted(STEP_FUNCTIONS))
    p.add_argument("--result", required=True, type=Path)
    p.add_argument("--until", type=float, default=float("inf"), help="unix time the supervisor stops the step at")
    args = p.parse_args(argv)
    on = device_stamp()
    print(f"{args.step} on {on['device']} with torch {on['torch']} (CUDA {on['torch_cuda']})", flush=True)
    workdir = ROOT / WORKDIR / args.step
    shutil.rmtree(workdir, ignore_errors=True)  # a warm box keeps the last call's files
    workdir.mkdir(parents=True)

    def report(figures: dict[str, Any], complete: bool = False) -> None:
        write_json(args.result, {"step": args.step, "status": "running", **figures, "on": on, "complete": complete})

    report(STEP_FUNCTIONS[args.step](workdir, report, args.until), complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
