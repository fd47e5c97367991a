"""Learning curves: return against env steps and wall time for several seeds, on CartPole, on the
Crafter cow task and on the Crafter benchmark, with the return of policies that do not learn
(random; on the cow task also a scripted player) measured in the same run. The Crafter benchmark is
scored as its paper scores it (overworld.envs.crafter_score): each seed's score over all its training
episodes up to 1M env steps, the mean and spread over seeds, a random policy's score measured here,
and the published scores beside them.

    python bench/bench_learning.py                  -> bench/results/learning.json
    BENCH_TASKS=cartpole BENCH_SEEDS=0 python bench/bench_learning.py

Knobs (environment): BENCH_TASKS (cartpole,crafter_cow,crafter), BENCH_SEEDS (0,1,2),
BENCH_CARTPOLE_STEPS (200000), BENCH_CRAFTER_STEPS (1000000, both Crafter tasks),
BENCH_RANDOM_EPISODES (20; on the Crafter benchmark 10x as many, for its success rates),
BENCH_BASELINES_ONLY=1 (re-measure the policies that do not learn into an existing result),
BENCH_MERGE=1 (keep the other seeds of an existing result), BENCH_WORKDIR (each run's directory,
logs and checkpoints there instead of in a temporary directory; run again, a finished seed is read
back and a seed cut short resumes from its latest checkpoint).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.runs import RESULTS, RunRecord, overworld_run, read_run, write
from overworld.core.config import load_config
from overworld.core.imports import call_generator, import_object
from overworld.envs.crafter_cow_scripted import ScriptedCowHunter
from overworld.envs.crafter_score import PUBLISHED_SCORES, score_summary

TASKS = {
    "cartpole": ("examples/cartpole.yaml", int(os.environ.get("BENCH_CARTPOLE_STEPS", 200_000))),
    "crafter_cow": ("examples/crafter_cow.yaml", int(os.environ.get("BENCH_CRAFTER_STEPS", 1_000_000))),
    "crafter": ("examples/crafter.yaml", int(os.environ.get("BENCH_CRAFTER_STEPS", 1_000_000))),
}


# Crafter as it comes (no cows summoned, no sword): where the issue's "a random policy eats about 0.01
# cows per episode" comes from; the cow task summons cows next to a player with a sword, as
# MineStudio's quick start does.
PLAIN_CRAFTER = {"num_cows": 0, "sword": None}
Chooser = Callable[[Any, np.random.Generator], int]


def random_action(env: Any, rng: np.random.Generator) -> int:
    return int(rng.integers(env.action_space.n))


def random_player(seed: int) -> Chooser:
    return random_action


def scripted_cow_hunter(seed: int) -> Chooser:
    hunter = ScriptedCowHunter(seed)
    return lambda env, rng: hunter.act(env)


def policy_return(config_path: str, episodes: int, player: Callable[[int], Chooser], seed: int = 0,
                  env_overrides: dict[str, Any] | None = None) -> dict[str, float]:
    """Mean return over `episodes` episodes, each played by a new `player(episode seed)`."""
    config = load_config(Path(__file__).resolve().parents[1] / config_path)
    env = call_generator(import_object(config.env_generator), {**config.env_kwargs, **(env_overrides or {})})
    rng = np.random.default_rng(seed)
    returns, lengths, achievements = [], [], []
    started = time.monotonic()
    for episode in range(episodes):
        env.reset(seed=seed + episode)
        act = player(seed + episode)
        total, length, done, info = 0.0, 0, False, {}
        while not done:
            _, reward, terminated, truncated, info = env.step(act(env, rng))
            total += float(reward)
            length += 1
            done = terminated or truncated
        returns.append(total)
        lengths.append(length)
        achievements.append(info.get("achievements", {}))
    env.close()
    out: dict[str, Any] = {"mean_return": float(np.mean(returns)), "std_return": float(np.std(returns)),
                           "mean_length": float(np.mean(lengths)), "episodes": episodes,
                           "seconds": round(time.monotonic() - started, 1)}
    keys = {k for a in achievements for k in a}
    crafter = score_summary({k: float(sum(a.get(k, 0.0) for a in achievements)) for k in keys}, episodes)
    if crafter is not None and config_path == TASKS["crafter"][0]:
        out["crafter"] = crafter
    return out


def baselines(task: str, config: str, episodes: int) -> dict[str, Any]:
    """Policies that do not learn, measured in the same run: random, and on the cow task also random
    on plain Crafter and a scripted player that reads the game's state."""
    if task == "crafter":  # success rates need many episodes; a random one lasts ~200 steps
        episodes *= 10
    out = {"random_policy": policy_return(config, episodes, random_player)}
    if task == "crafter_cow":
        out["random_policy_plain_crafter"] = policy_return(config, episodes, random_player, env_overrides=PLAIN_CRAFTER)
        out["scripted_policy"] = policy_return(config, episodes, scripted_cow_hunter)
    for name, value in out.items():
        print(task, name, value, flush=True)
    return out


def crafter_scores(entry: dict[str, Any]) -> dict[str, Any]:
    """Each seed's Crafter score (over all its training episodes), their mean and standard deviation
    over seeds as Crafter's analysis reports them, beside the published table."""
    scores = {seed: s["tasks"]["crafter"]["crafter"]["score"] for seed, s in entry["seeds"].items()
              if (s.get("tasks") or {}).get("crafter", {}).get("crafter")}
    values = list(scores.values())
    return {"crafter_score_per_seed": scores,
            "crafter_score_mean": float(np.mean(values)) if values else None,
            "crafter_score_std": float(np.std(values)) if values else None,
            "published_scores_at_1m_steps": PUBLISHED_SCORES}


CURVE_POINTS = 50  # per seed in the committed result: a curve to plot, not the run's every line (Crafter's 3 seeds: ~120 KB)


def downsample(curve: list[dict[str, Any]], points: int = CURVE_POINTS) -> list[dict[str, Any]]:
    """`points` evenly spaced entries of `curve`, its first and last among them."""
    if len(curve) <= points:
        return curve
    return [curve[round(i * (len(curve) - 1) / (points - 1))] for i in range(points)]


def main() -> None:
    tasks = os.environ.get("BENCH_TASKS", ",".join(TASKS)).split(",")
    seeds = [int(s) for s in os.environ.get("BENCH_SEEDS", "0,1,2").split(",")]
    episodes = int(os.environ.get("BENCH_RANDOM_EPISODES", 20))
    baselines_only = os.environ.get("BENCH_BASELINES_ONLY") == "1"
    merge = os.environ.get("BENCH_MERGE") == "1"
    workdir = os.environ.get("BENCH_WORKDIR")
    result: dict[str, Any] = {"tasks": {}}
    for task in tasks:
        config, steps = TASKS[task]
        name = "learning" if set(tasks) == set(TASKS) else "learning_" + "_".join(tasks)
        if baselines_only:  # re-measure the baselines of an existing result, keeping its seeds
            path = RESULTS / f"{name}.json"
            result = json.loads(path.read_text()) if path.exists() else result
            result.setdefault("tasks", {}).setdefault(task, {}).update(baselines(task, config, episodes))
            for key in ("benchmark", "date", "cpus"):  # write() stamps them anew
                result.pop(key, None)
            write(name, result)
            continue
        entry: dict[str, Any] = {"config": config, "max_env_steps": steps, **baselines(task, config, episodes),
                                 "seeds": {}}
        if merge:  # keep the seeds of an earlier result that this run does not train again
            path = RESULTS / f"{name}.json"
            earlier = json.loads(path.read_text())["tasks"].get(task, {}) if path.exists() else {}
            entry["seeds"] = {k: v for k, v in earlier.get("seeds", {}).items() if int(k) not in seeds}
        result["tasks"][task] = entry
        for seed in seeds:
            ran: dict[str, Any] = {}  # the run's commit, start and load, as it ran (none for a run read back)
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = Path(workdir) / f"{task}-seed{seed}" if workdir else Path(tmp) / "run"
                if (run_dir / "summary.json").exists() and read_run(run_dir).get("status") == "max_env_steps":
                    summary = read_run(run_dir)  # finished before: a bench that was cut short goes on from here
                else:  # a run cut short resumes from its latest checkpoint, counters and curve carried on
                    resume = ["--resume", "latest"] if (run_dir / "config.yaml").exists() else []
                    with RunRecord() as record:
                        summary = overworld_run(config, run_dir, "--max-env-steps", str(steps), "--set",
                                                f"seed={seed}", *resume)
                    ran = record.fields
                written = run_dir / "summary.json"  # when the seed finished, also for one read back
                finished = time.localtime(written.stat().st_mtime if written.exists() else None)
            entry["seeds"][str(seed)] = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S", finished)} | {k: summary.get(k) for k in (
                "status", "env_steps", "episodes", "mean_return_last_100", "wall_seconds", "wall_seconds_all_segments",
                "env_steps_per_second", "resumed_from", "env_steps_used", "env_steps_not_trained", "idle_share",
                "model_version", "updates", "tasks")} | ran | {"curve": downsample(summary.get("curve", []))}
            if summary.get("wall_seconds_all_segments"):  # a seed run in segments: its rate over all of them
                entry["seeds"][str(seed)]["env_steps_per_second"] = round(
                    summary["env_steps"] / summary["wall_seconds_all_segments"], 1)
            print(task, "seed", seed, {k: v for k, v in entry["seeds"][str(seed)].items() if k != "curve"}, flush=True)
            write(name, result)  # after every seed: a long run that is cut short keeps what it measured
        finals = [s["mean_return_last_100"] for s in entry["seeds"].values() if s["mean_return_last_100"] is not None]
        entry["final_mean_return_over_seeds"] = float(np.mean(finals)) if finals else None
        if task == "crafter":
            entry.update(crafter_scores(entry))
        write(name, result)
    print("results in", RESULTS)


if __name__ == "__main__":
    main()
