"""`make gpu-check`: every CUDA path of Overworld and the published Crafter recipe, in one command, on the
first GPU box at hand (issue 24). No network; resumable: each command does what fits in its budget
(`--budget`, 540 s: commands of at most 10 minutes), keeps its state on disk (`--state`, default
runs/gpu-check) and says whether to run it again (exit status 75) or that everything is done (0).

Steps, each once, in this order:
1. rollout   a rollout worker's env steps/s with examples/crafter_resnet.yaml's ResNet, inference on
             CUDA and on the CPU, in the same command: 16 Crafter envs in groups of 8 over 8 env
             processes (bench/bench_rollout_worker.py's WorkerBench; nothing trains);
2. vpt2x     one PPO iteration with the VPT-2x architecture (random weights: bench/gpu/vpt_standin.py, a
             stand-in of VPT-2x's shape and exact parameter count, as MineStudio cannot be on the box) at
             MineStudio's quick-start batch settings per GPU (examples/minecraft_kill_cow.py: 200 chains of
             256 steps, context 64, gradient accumulation 10, KL to a frozen reference) under bf16
             autocast: samples/s and torch.cuda.max_memory_allocated;
3. amp_fp16  `use_amp` with `amp_dtype: float16` (MineStudio's fp16 + GradScaler) on CUDA: two updates of
             the Crafter ResNet, the scaler's state through a checkpoint and a resume;
4. crafter   the Crafter benchmark with examples/crafter_resnet.yaml, 1M env steps per seed (`--seeds`,
             as many as the budget allows), each seed in segments: when a command's time runs out the
             run is stopped as Ctrl-C stops it (the trainer checkpoints) and the next command resumes it
             (`overworld run --resume latest`); the score is Crafter's, over all of a seed's episodes of
             all its segments.
Results: bench/results/gpu.json (the device's name, driver and torch version with every figure) and
their rows in bench/results/REPORT.md (bench/report.py).

On the box the wheels of bench/gpu/wheels.txt (gpu-wheels/, `make gpu-wheels` where pip reaches an
index) are installed into .gpu-site/ first. `--dry` (make gpu-check DRY=1) runs every step on the CPU
with tiny sizes, with every package the box would lack made unimportable (bench/gpu/box.py), and writes
its results under its state directory, never bench/results.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [p for p in (str(ROOT / "services"), str(ROOT)) if p not in sys.path]

from bench.gpu import box  # noqa: E402

STEPS = ("rollout", "vpt2x", "amp_fp16", "crafter")
# Seconds a step needs at least (the real one): a command with less left leaves it to the next.
NEEDS = {"rollout": 150, "vpt2x": 240, "amp_fp16": 60}
MAX_ATTEMPTS = 2  # a step that failed (or ran out of time) this often is recorded as failed, and skipped
CRAFTER_CONFIG = "examples/crafter_resnet.yaml"
CRAFTER_MIN_SEGMENT = 150.0  # seconds: a segment shorter than this spends most of it starting
CRAFTER_STOP_MARGIN = 75.0  # seconds between a segment's stop signal and the command's end
EXIT_AGAIN = 75  # EX_TEMPFAIL: not finished, run again
REEXEC = "OVERWORLD_GPU_CHECK_ENV"
STARTED = "OVERWORLD_GPU_CHECK_STARTED"

# The dry run's sizes: tiny, on the CPU.
DRY_CRAFTER = ["train_config.num_gpus_per_worker=0", "rollout_config.num_gpus_per_worker=0",
               "rollout_config.worker_config.device=cpu", "rollout_config.worker_config.num_envs=4",
               "rollout_config.worker_config.batch_size=2", "rollout_config.worker_config.num_env_processes=2",
               "rollout_config.fragment_length=16", "train_config.context_length=16",
               "train_config.batch_size_per_gpu=2", "train_config.batches_per_iteration=2",
               "rollout_config.replay_buffer_config.min_size_to_sample=4",
               "rollout_config.replay_buffer_config.samples_per_insert_error=4", "train_config.save_interval=1",
               "policy_kwargs.channels=[8,16,16]", "policy_kwargs.dense=32", "policy_kwargs.hidden=64"]
DRY_VPT = ["rollout_config.fragment_length=8", "train_config.context_length=4", "train_config.batches_per_iteration=2",
           "train_config.gradient_accumulation=2"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="every step on the CPU, tiny, the box simulated")
    p.add_argument("--state", default=None, help="state directory (runs/gpu-check, dry: runs/gpu-check-dry)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds this command may take")
    p.add_argument("--seeds", default=None, help="Crafter seeds, in order, as many as the budget allows (0,1,2; dry 0)")
    p.add_argument("--crafter-steps", type=int, default=None, help="env steps per seed (1,000,000; dry 2,048)")
    p.add_argument("--segment-steps", type=int, default=None,
                   help="at most this many env steps per segment (dry: 1,024, so a seed resumes once)")
    p.add_argument("--segment-seconds", type=float, default=None,
                   help="stop each segment after this long (as a command's end does), resume in the next")
    p.add_argument("--max-segments", type=int, default=None, help="Crafter segments in this command at most")
    p.add_argument("--steps", default=",".join(STEPS), help="which steps to run")
    p.add_argument("--no-wheels", action="store_true", help="use this Python's packages as they are")
    p.add_argument("--reset", action="store_true", help="forget the state and start over")
    p.add_argument("--step", choices=STEPS[:-1], help=argparse.SUPPRESS)  # one step, in a child process
    return p.parse_args(argv)


# -- state ------------------------------------------------------------------------------------------
class State:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.path = directory / "state.json"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data.setdefault("steps", {})
        self.data.setdefault("crafter", {"seeds": {}})

    def step(self, name: str) -> dict[str, Any]:
        return self.data["steps"].setdefault(name, {"done": False, "attempts": 0})

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


# -- the device --------------------------------------------------------------------------------------
def describe_device(dry: bool) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "python": platform.python_version(), "cpus": os.cpu_count(), "dry_run": dry}
    if dry or not torch.cuda.is_available():
        out.update(device="cpu" + (" (dry run)" if dry else ""), driver=None)
        return out
    props = torch.cuda.get_device_properties(0)
    driver = None
    if shutil.which("nvidia-smi"):
        found = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, check=False)
        driver = found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else None
    out.update(device=props.name, driver=driver, capability=f"{props.major}.{props.minor}",
               memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
    return out


def stamp(device: dict[str, Any]) -> dict[str, Any]:
    """What goes with every figure."""
    return {k: device.get(k) for k in ("device", "driver", "torch", "torch_cuda")}


def cuda_device(dry: bool) -> Any:
    import torch

    return torch.device("cpu") if dry else torch.device("cuda", 0)


def peak_memory(device: Any) -> dict[str, float]:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {"max_memory_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
                "max_memory_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)}
    rss = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return {"peak_rss_gib": round(rss / 2**20, 2)}


# -- step 1: rollout worker on CUDA vs the CPU ------------------------------------------------------
def step_rollout(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from bench.bench_rollout_worker import WorkerBench

    cpus = os.cpu_count() or 2
    envs, batch, procs, seconds = (4, 2, 2, 2.0) if args.dry else (16, 8, min(8, max(2, cpus // 2)), 20.0)
    rows: dict[str, Any] = {}
    for name, device in (("cuda", "cpu" if args.dry else "cuda"), ("cpu", "cpu")):
        # the CPU row's inference gets the cores the env processes leave (the CUDA row needs one)
        threads = 1 if name == "cuda" or args.dry else max(1, cpus - procs)
        bench = WorkerBench(None, envs, workdir / name, batch_size=batch, config_path=CRAFTER_CONFIG, overrides=(
            f"rollout_config.worker_config.device={device}", f"rollout_config.worker_config.num_env_processes={procs}",
            f"rollout_config.num_cpus_per_worker={threads}"))
        try:
            rows[name] = {**bench.measure(seconds), "inference_device": device, "inference_threads": threads}
        finally:
            bench.close()
        print(f"rollout {name}: {rows[name]['env_steps_per_second']:.0f} env steps/s", flush=True)
    return {"config": CRAFTER_CONFIG, "policy": "the recipe's IMPALA ResNet (3.9 M parameters, ~0.46 GFLOP/frame)",
            "num_envs": envs, "batch_size": batch, "env_processes": procs, "seconds_per_row": seconds,
            "rows": rows, "cuda_over_cpu": round(rows["cuda"]["env_steps_per_second"]
                                                 / max(rows["cpu"]["env_steps_per_second"], 1e-9), 2)}


# -- a synthetic batch --------------------------------------------------------------------------------
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


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- step 2: one PPO iteration of VPT-2x under bf16 autocast -------------------------------------------
def step_vpt2x(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    from bench.gpu.vpt_standin import TINY, VPT_2X, VPTStandIn, count_parameters
    from overworld.core.config import load_config
    from overworld.online import PPOTrainer

    shape = TINY if args.dry else VPT_2X
    device = cuda_device(args.dry)

    class VPTTrainer(PPOTrainer):
        def build_policy(self) -> Any:
            policy = VPTStandIn(shape)
            policy.value_normalizer.enabled = self.config.train_config.use_normalized_vf
            return policy

    # MineStudio's quick start, per GPU: batch_size_per_gpu 1 x batches_per_iteration 200 chains of 256 steps
    config = load_config(ROOT / "examples" / "minecraft_kill_cow.py", [
        "train_config.use_amp=true", "train_config.amp_dtype=bfloat16", "train_config.save_interval=0",
        *(DRY_VPT if args.dry else [])])
    t = config.train_config
    started = time.monotonic()
    torch.manual_seed(0)
    trainer = VPTTrainer.from_config(config, rollout_manager="")
    trainer.device = device
    trainer.model, trainer.optimizer = trainer.setup_model_and_optimizer()
    trainer.gae_client = LocalGae()
    built = time.monotonic() - started
    chains, steps = t.batch_size_per_gpu * t.batches_per_iteration, config.rollout_config.fragment_length
    frame, actions = (shape.image, shape.image, 3), dict(shape.actions)
    policy = trainer.unwrapped_model

    def iteration(n: int, seed: int) -> tuple[float, dict[str, float]]:
        batch = synthetic_batch(policy, "image", frame, actions, n, steps, seed)
        t.batches_per_iteration = n // t.batch_size_per_gpu
        t.gradient_accumulation = min(t.gradient_accumulation, t.batches_per_iteration)
        synchronize(device)
        began = time.monotonic()
        trainer.iteration += 1
        trainer.estimate_advantages(batch)
        metrics = trainer.train_iteration(batch) or {}
        synchronize(device)
        return time.monotonic() - began, metrics

    accumulation = t.gradient_accumulation
    warm_chains = min(chains, 2 * t.batch_size_per_gpu)
    iteration(warm_chains, 1)  # kernels chosen, the optimizer's state allocated: outside the measurement
    t.gradient_accumulation = accumulation
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, metrics = iteration(chains, 2)
    samples = chains * steps
    finite = all(v == v and abs(v) != float("inf") for k, v in metrics.items() if k.endswith("_loss"))
    return {
        "model": "VPT-2x stand-in (bench/gpu/vpt_standin.py): VPT-2x's layers and widths, MineStudio not on the box"
                 if not args.dry else "the VPT stand-in at a tiny width (dry run)",
        "parameters": sum(p.numel() for p in policy.parameters()),
        "parameters_vpt_2x": count_parameters(VPT_2X),
        "settings": {"chains": chains, "steps_per_chain": steps, "context_length": t.context_length,
                     "batch_size_per_gpu": t.batch_size_per_gpu, "gradient_accumulation": accumulation,
                     "epochs_per_iteration": t.epochs_per_iteration,
                     "kl_divergence_coef_rho": t.kl_divergence_coef_rho, "reference_policy": trainer.reference is not None,
                     "inference_batch_size_per_gpu": trainer.inference_batch_size_per_gpu,
                     "autocast": str(trainer.amp_dtype), "grad_scaler": trainer.scaler is not None,
                     "source": "examples/minecraft_kill_cow.py (MineStudio's quick start), one GPU's share"},
        "seconds_to_build": round(built, 1), "iteration_seconds": round(seconds, 2),
        "samples_per_second": round(samples / seconds, 1), "samples": samples,
        "parts_seconds": {**{k: round(v, 2) for k, v in trainer.timings.items()},
                          "update": round(seconds - sum(trainer.timings.get(k, 0.0) for k in ("values", "gae")), 2)},
        "optimizer_steps": trainer.updates, "skipped_steps": metrics.get("trainer/skipped_steps"),
        "losses_finite": finite, **peak_memory(device),
    }


# -- step 3: fp16 autocast with a GradScaler, through a checkpoint ---------------------------------------
def step_amp_fp16(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    from overworld.core.config import load_config
    from overworld.online import PPOTrainer
    from overworld.trainer.checkpoint import checkpoint_store

    device = cuda_device(args.dry)
    overrides = ["train_config.use_amp=true", "train_config.amp_dtype=float16", "run_id=amp-fp16",
                 "train_config.batch_size_per_gpu=2", "train_config.batches_per_iteration=2",
                 *(["policy_kwargs.channels=[8,16,16]", "policy_kwargs.dense=32", "policy_kwargs.hidden=64"]
                   if args.dry else [])]

    def trainer(*extra: str) -> PPOTrainer:
        config = load_config(ROOT / CRAFTER_CONFIG, [*overrides, *extra])
        torch.manual_seed(0)
        tr = PPOTrainer.from_config(config, rollout_manager="", workdir=str(workdir))
        tr.device = device
        tr.model, tr.optimizer = tr.setup_model_and_optimizer()
        tr.checkpoints = checkpoint_store(tr.config, tr.workdir)
        return tr

    shutil.rmtree(workdir / "output", ignore_errors=True)
    first = trainer()
    batch = synthetic_batch(first.unwrapped_model, "obs", (64, 64, 3), {"action": 17}, 4, 64, 3)
    batch.advantage, batch.value_target = torch.randn(4, 64), torch.randn(4, 64)
    batch.old_vpred = torch.zeros(4, 64)
    seen: list[str] = []
    first.unwrapped_model.encoder[0][0].conv.layer.register_forward_hook(lambda _m, _i, out: seen.append(str(out.dtype)))
    before = torch.cat([p.detach().flatten().float().cpu() for p in first.unwrapped_model.parameters()])
    metrics = first.update(batch)
    after = torch.cat([p.detach().flatten().float().cpu() for p in first.unwrapped_model.parameters()])
    scale = first.scaler.get_scale() if first.scaler is not None else None
    first.iteration = 1
    ckpt = first.save_checkpoint()
    resumed = trainer("train_config.resume=latest")
    resumed.restore()
    return {"autocast": str(first.amp_dtype), "forward_dtypes": sorted(set(seen)),
            "grad_scaler": type(first.scaler).__name__ if first.scaler is not None else None,
            "scale_after_update": scale, "optimizer_steps": first.updates,
            "skipped_steps": metrics["trainer/skipped_steps"],
            "weights_changed": bool(not torch.equal(before, after)), "weights_finite": bool(torch.isfinite(after).all()),
            "checkpoint": ckpt, "scaler_restored": resumed.scaler is not None
            and resumed.scaler.state_dict() == first.scaler.state_dict()}


# -- step 4: the Crafter benchmark, in segments ------------------------------------------------------------
def combined_score(segments: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Crafter's score over all the episodes of all segments (each segment's rollout-manager counts its own)."""
    from overworld.envs.crafter_score import ACHIEVEMENTS, crafter_score

    episodes = sum(s.get("episodes_scored", 0) for s in segments)
    if not episodes:
        return None
    unlocked = {a: sum(s["success_rates"][a] / 100.0 * s["episodes_scored"] for s in segments if s.get("episodes_scored"))
                for a in ACHIEVEMENTS}
    rates = {a: 100.0 * n / episodes for a, n in unlocked.items()}
    return {"score": crafter_score(rates), "episodes": episodes, "success_rates": {a: round(r, 2) for a, r in rates.items()}}


def crafter_target(args: argparse.Namespace) -> int:
    return args.crafter_steps or (2048 if args.dry else 1_000_000)


def step_crafter(args: argparse.Namespace, state: State, deadline: float) -> bool:
    """Segments until the seeds are done or the time is up; returns True when every seed is done."""
    from bench.runs import overworld_run

    target = crafter_target(args)
    per_segment = args.segment_steps or (1024 if args.dry else None)
    overrides = ["logger_config.wandb=false", *(DRY_CRAFTER if args.dry else [])]
    seeds = state.data["crafter"]["seeds"]
    segments = 0
    for seed in [int(s) for s in (args.seeds or ("0" if args.dry else "0,1,2")).split(",") if s.strip()]:
        rec = seeds.setdefault(str(seed), {"done": False, "env_steps": 0, "segments": []})
        while not rec["done"]:
            if args.max_segments is not None and segments >= args.max_segments:
                return False
            segments += 1
            left = deadline - time.time() - CRAFTER_STOP_MARGIN
            if left < (10.0 if args.dry else CRAFTER_MIN_SEGMENT):
                print(f"crafter seed {seed}: {max(left, 0):.0f}s left in this command; the next one goes on", flush=True)
                return False
            run_dir = state.dir / f"crafter-seed{seed}"
            resume = ["--resume", "latest"] if (run_dir / "config.yaml").exists() else []
            goal = min(target, rec["env_steps"] + per_segment) if per_segment else target
            sets = [x for o in [f"seed={seed}", *overrides] for x in ("--set", o)]
            began = time.time()
            summary = overworld_run(CRAFTER_CONFIG, run_dir, "--max-env-steps", str(goal), *sets, *resume,
                                    stop_after=min(left, args.segment_seconds or left), timeout=CRAFTER_STOP_MARGIN - 10)
            crafter = ((summary.get("tasks") or {}).get("crafter") or {}).get("crafter") or {}
            segment = {k: summary.get(k) for k in ("status", "env_steps", "start_env_steps", "episodes", "wall_seconds",
                                                   "env_steps_per_second", "resumed_from", "model_version", "updates",
                                                   "latest_checkpoint", "error")}
            segment.update(started_unix=round(began), episodes_scored=crafter.get("episodes", 0),
                           success_rates=crafter.get("success_rates", {}), segment_score=crafter.get("score"))
            rec["segments"].append(segment)
            rec["env_steps"] = max(rec["env_steps"], int(summary.get("env_steps") or 0))
            rec["done"] = summary.get("status") == "max_env_steps" and rec["env_steps"] >= target
            rec["crafter"] = combined_score(rec["segments"])
            rec["wall_seconds"] = round(sum(s.get("wall_seconds") or 0 for s in rec["segments"]), 1)
            state.save()
            print(f"crafter seed {seed}: {segment['status']} at {rec['env_steps']:,} env steps "
                  f"({segment['env_steps_per_second']} /s); score so far "
                  f"{(rec['crafter'] or {}).get('score')}", flush=True)
            if summary.get("status") in ("failed", "no summary"):
                failures = sum(s.get("status") in ("failed", "no summary") for s in rec["segments"])
                if failures >= MAX_ATTEMPTS:
                    rec["done"], rec["failed"] = True, True
                    print(f"crafter seed {seed}: failed {failures} times; see {run_dir}/logs", flush=True)
                    state.save()
                    break
    return True


def crafter_result(state: State, target: int) -> dict[str, Any]:
    import statistics

    from overworld.envs.crafter_score import PUBLISHED_SCORES

    seeds = state.data["crafter"]["seeds"]
    finished = {s: r["crafter"]["score"] for s, r in seeds.items()
                if r.get("done") and not r.get("failed") and r.get("crafter")}
    return {"config": CRAFTER_CONFIG, "env_steps_per_seed": target, "seeds": seeds,
            "score_per_finished_seed": finished,
            "score_mean": statistics.fmean(finished.values()) if finished else None,
            "score_std": statistics.pstdev(finished.values()) if finished else None,
            "published_ppo_resnet": PUBLISHED_SCORES["PPO (ResNet)"],
            "note": "score over every episode a seed finished in any segment; the episodes running when a "
                    "segment stopped are not counted (their env steps are)"}


# -- results ------------------------------------------------------------------------------------------
def write_results(args: argparse.Namespace, state: State, device: dict[str, Any]) -> Path:
    import bench.report as report

    on = stamp(device)
    steps = state.data["steps"]
    result: dict[str, Any] = {"benchmark": "gpu", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "dry_run": args.dry,
                              "device": device}
    for name in STEPS[:-1]:
        s = steps.get(name, {})
        result[name] = ({"on": on, **s["result"]} if s.get("result") else
                        {"on": on, "status": "failed" if s.get("failed") else "not run yet", "error": s.get("error")})
    target = crafter_target(args)
    result["crafter"] = {"on": on, **crafter_result(state, target)}
    if args.dry:
        path = state.dir / "gpu.json"
        path.write_text(json.dumps(result, indent=2))
        rows = ["| bench | what | measured | target |", "|---|---|---|---|", *report.headline_rows("gpu", result)]
        (state.dir / "REPORT.md").write_text("\n".join(["# gpu-check dry run", "", *rows, ""]))
        return path
    path = report.RESULTS / "gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    with contextlib.redirect_stdout(io.StringIO()):  # it prints the whole report
        report.main()
    return path


# -- the command ----------------------------------------------------------------------------------------
def run_step(args: argparse.Namespace) -> int:
    """In a child process: one step; its result (or error) in <state>/<step>.json."""
    state_dir = Path(args.state)
    workdir = state_dir / args.step
    workdir.mkdir(parents=True, exist_ok=True)
    fn = {"rollout": step_rollout, "vpt2x": step_vpt2x, "amp_fp16": step_amp_fp16}[args.step]
    result = fn(args, workdir)
    (state_dir / f"{args.step}.json").write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.state = args.state or str(ROOT / "runs" / ("gpu-check-dry" if args.dry else "gpu-check"))
    state_dir = Path(args.state).resolve()
    args.state = str(state_dir)
    if args.step:
        return run_step(args)
    if os.environ.get(REEXEC) != "1":  # put the box's packages in place, then this script again
        if args.reset:
            shutil.rmtree(state_dir, ignore_errors=True)
        env = box.simulate(state_dir / "box") if args.dry else {} if args.no_wheels else box.install_wheels()
        env.update({REEXEC: "1", STARTED: os.environ.get(STARTED) or str(time.time()), "PYTHONUNBUFFERED": "1"})
        argv_out = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--reset"]
        return subprocess.call([sys.executable, "-m", "bench.gpu.check", *argv_out], cwd=ROOT, env={**os.environ, **env})
    deadline = float(os.environ[STARTED]) + args.budget
    import torch

    if not args.dry and not torch.cuda.is_available():
        print(f"no usable CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}): this is the GPU "
              "check; `make gpu-check DRY=1` runs its steps on the CPU", file=sys.stderr)
        return 2
    state = State(state_dir)
    device = describe_device(args.dry)
    state.data["device"] = device
    state.save()
    wanted = [s for s in args.steps.split(",") if s]
    print(f"gpu-check{' (dry run)' if args.dry else ''} on {device['device']} (driver {device['driver']}, torch "
          f"{device['torch']}); state in {state_dir}; {deadline - time.time():.0f}s in this command", flush=True)
    for name in [s for s in STEPS[:-1] if s in wanted]:
        rec = state.step(name)
        if rec["done"]:
            continue
        left = deadline - time.time()
        if not args.dry and left < NEEDS[name]:
            print(f"{name}: {left:.0f}s left, it needs ~{NEEDS[name]}s: the next command runs it", flush=True)
            break
        rec["attempts"] += 1
        state.save()
        print(f"== {name}", flush=True)
        began = time.time()
        out = state_dir / f"{name}.json"
        out.unlink(missing_ok=True)
        try:
            code = subprocess.call([sys.executable, "-m", "bench.gpu.check", "--step", name, "--state", str(state_dir),
                                    *(["--dry"] if args.dry else [])], cwd=ROOT, timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            code = "timed out"
        if code == 0 and out.exists():
            rec.update(done=True, result=json.loads(out.read_text()), seconds=round(time.time() - began, 1))
        else:
            rec["error"] = f"exit {code}" if code != "timed out" else "ran out of this command's time"
            if rec["attempts"] >= MAX_ATTEMPTS:
                rec.update(done=True, failed=True)
            print(f"{name}: {rec['error']} (attempt {rec['attempts']} of {MAX_ATTEMPTS})", flush=True)
        state.save()
        write_results(args, state, device)
    crafter_done = True
    if "crafter" in wanted and all(state.step(s)["done"] for s in STEPS[:-1] if s in wanted):
        print("== crafter", flush=True)
        crafter_done = step_crafter(args, state, deadline)
    elif "crafter" in wanted:
        crafter_done = False
    path = write_results(args, state, device)
    done = crafter_done and all(state.step(s)["done"] for s in STEPS[:-1] if s in wanted)
    failed = [s for s in STEPS[:-1] if state.step(s).get("failed")]
    print(f"results: {path}")
    if not done:
        print(f"gpu-check: not finished; run it again (`make gpu-check{' DRY=1' if args.dry else ''}`) and it goes on "
              f"from {state_dir}", flush=True)
        return EXIT_AGAIN
    print(f"gpu-check: done{'; failed: ' + ', '.join(failed) if failed else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
