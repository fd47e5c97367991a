"""Every benchmark result side by side: bench/results/*.json -> bench/results/REPORT.md (and stdout).

First the headlines (each target next to what was measured, the learning results per seed with
the baselines of the same run), then every number of every result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def flatten(prefix: str, value: object, out: dict[str, object]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "curve":
                flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif not isinstance(value, list):
        out[prefix] = value


def learning_rows(name: str, data: dict[str, Any]) -> list[str]:
    rows = []
    for task, entry in data.get("tasks", {}).items():
        baselines = ", ".join(f"{k.replace('_policy', '')} {v['mean_return']}"
                              for k, v in entry.items() if isinstance(v, dict) and "mean_return" in v)
        for seed, run in sorted(entry.get("seeds", {}).items()):
            wall = run.get("wall_seconds_all_segments") or run.get("wall_seconds")
            rows.append(f"| {name} | {task} seed {seed}: return (last 100 episodes) after {run.get('env_steps')} "
                        f"env steps, {wall:.0f} s | {run.get('mean_return_last_100')} | baselines: {baselines} |")
    return rows


def headline_rows(name: str, data: dict[str, Any]) -> list[str]:
    if "tasks" in data:
        return learning_rows(name, data)
    if name == "registry":
        return [f"| registry | push to {data['workers']} workers at {size} vs one plain gRPC stream | "
                f"{s['ratio']:.2f}× ({s['ratio_to_keep']:.2f}× of receivers keeping the bytes) | "
                f"≤ 1.3×: {'met' if s['within_target'] else 'missed'} |" for size, s in data["summary"].items()]
    if name == "rollout_worker":
        bare = data["bare_processes_2_envs_random_actions"]["env_steps_per_second"]
        return [f"| rollout_worker | {key}: fraction of bare env processes | {row['env_steps_per_second'] / bare:.2f} | "
                f"≥ {data['target_fraction_of_bare']} |"
                for key, row in data.items() if isinstance(row, dict) and key.startswith(("rollout_worker", "gym"))]
    if name == "replay_buffer":
        judged = ("worst_ratio_vs_raw", "worst_cpu_ratio_vs_raw")  # ingest and sample by reference
        return [f"| replay_buffer | Redis + S3 vs raw Redis + S3: {key} | {data[key]:.2f} | "
                f"{'≥ ' + str(data['target_ratio']) if key in judged else '(reported beside)'} |"
                for key in data if key.startswith("worst_") and isinstance(data[key], (int, float))]
    if name == "recovery":
        return [f"| recovery | {backend}: {service} killed -> first call answered / run going on (s) | "
                f"{row['first_call_seconds']} / {row['run_going_on_seconds']} | |"
                for backend, services in data["backends"].items() for service, row in services.items()]
    if name == "e2e_cartpole":
        return [f"| e2e_cartpole | env steps / wall seconds to a 100-episode mean of 450 | "
                f"{data.get('steps_to_450')} / {data.get('wall_seconds_to_450')} | |",
                f"| e2e_cartpole | env steps/s training through every service vs stepping the envs bare with "
                f"random actions | {data.get('overworld_env_steps_per_second')} vs "
                f"{data.get('bare_loop_env_steps_per_second')} | |"]
    return []


def main() -> None:
    results = {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}
    lines = ["# Benchmark results", "", "## Headlines", "", "| bench | what | measured | target |", "|---|---|---|---|"]
    for name, data in results.items():
        try:
            lines += headline_rows(name, data)
        except (KeyError, TypeError, ValueError) as err:  # an older result layout: its numbers are below
            lines.append(f"| {name} | (no headline: {type(err).__name__} {err}) | | |")
    lines.append("")
    for name, data in results.items():
        flat: dict[str, object] = {}
        flatten("", data, flat)
        lines += [f"## {name}", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in flat.items()]
        lines.append("")
    text = "\n".join(lines)
    (RESULTS / "REPORT.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
