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
            score = ((run.get("tasks") or {}).get(task) or {}).get("crafter")
            if score:  # the Crafter benchmark: the score over all the seed's episodes, as its paper reports it
                random_score = (entry.get("random_policy") or {}).get("crafter", {}).get("score")
                published = ", ".join(f"{k} {v}" for k, v in entry.get("published_scores_at_1m_steps", {}).items())
                rows.append(f"| {name} | {task} seed {seed}: Crafter score after {run.get('env_steps')} env steps "
                            f"| {score['score']:.2f} | random here {random_score:.2f}; published at 1M: {published} |")
        if entry.get("crafter_score_mean") is not None:
            best_ppo = entry.get("published_scores_at_1m_steps", {}).get("PPO (ResNet)")
            met = "met" if best_ppo is not None and entry["crafter_score_mean"] > best_ppo else "missed"
            rows.append(f"| {name} | {task}: mean Crafter score over {len(entry['seeds'])} seeds, ± std "
                        f"| {entry['crafter_score_mean']:.2f} ± {entry['crafter_score_std']:.2f} "
                        f"| goal > {best_ppo} (the published PPO with a ResNet): {met} |")
    return rows


def tls_rows(name: str, what: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """Mutual TLS on vs off, measured in the same run: the share of throughput TLS costs."""
    return [f"| {name} | {what} {key}: throughput lost to mutual TLS | {row['throughput_cost']:.1%} | "
            f"≤ 10%: {'met' if row['within_target'] else 'missed'} |" for key, row in rows.items()]


def gpu_rows(data: dict[str, Any]) -> list[str]:
    """bench/gpu/check.py (`make gpu-check`): each figure with the device, driver and torch it ran on."""
    def on(section: dict[str, Any]) -> str:
        o = section.get("on", {})
        return f"{o.get('device')}, driver {o.get('driver')}, torch {o.get('torch')}"

    rows = []
    r = data.get("rollout", {})
    if "rows" in r:
        rows.append(f"| gpu | rollout worker, {r['num_envs']} Crafter envs in groups of {r['batch_size']}, the recipe's "
                    f"ResNet: env steps/s with inference on CUDA vs on the CPU ({on(r)}) | "
                    f"{r['rows']['cuda']['env_steps_per_second']:.0f} vs {r['rows']['cpu']['env_steps_per_second']:.0f} "
                    f"({r['cuda_over_cpu']}×) | |")
    v = data.get("vpt2x", {})
    if "samples_per_second" in v:
        memory = v.get("max_memory_allocated_gib", v.get("peak_rss_gib"))
        rows.append(f"| gpu | one PPO iteration, VPT-2x stand-in ({v['parameters'] / 1e6:.1f} M), MineStudio's quick-start "
                    f"batch ({v['settings']['chains']} chains x {v['settings']['steps_per_chain']} steps), "
                    f"{v['settings']['autocast']}: samples/s, peak memory GiB ({on(v)}) | "
                    f"{v['samples_per_second']}, {memory} | |")
    a = data.get("amp_fp16", {})
    if "scaler_restored" in a:
        rows.append(f"| gpu | use_amp fp16 + GradScaler: steps taken, scaler restored from the checkpoint ({on(a)}) | "
                    f"{a['optimizer_steps'] - a['skipped_steps']:.0f} of {a['optimizer_steps']}, {a['scaler_restored']} | |")
    c = data.get("crafter", {})
    for seed, rec in sorted(c.get("seeds", {}).items()):
        score = (rec.get("crafter") or {}).get("score")
        rows.append(f"| gpu | Crafter benchmark, {c['config']}, seed {seed}: score after {rec.get('env_steps'):,} env steps "
                    f"({len(rec.get('segments', []))} segments{'' if rec.get('done') else ', not finished'}; {on(c)}) | "
                    f"{'n/a' if score is None else f'{score:.2f}'} | published PPO (ResNet) {c.get('published_ppo_resnet')} |")
    if c.get("score_mean") is not None:
        rows.append(f"| gpu | Crafter benchmark, mean ± std over {len(c['score_per_finished_seed'])} finished seeds | "
                    f"{c['score_mean']:.2f} ± {c['score_std']:.2f} | > {c.get('published_ppo_resnet')} |")
    return rows


def scale_rows(data: dict[str, Any]) -> list[str]:
    """The scaling curve (bench/bench_scale.py): one row per weights push mode and fleet size, the
    relay's flatness against the goal, churn and the soak."""
    rows = []
    link = f"{data['weights_mb']:.0f} MB at {data['link_mbit']:.0f} Mbit/s"
    for mode, curve in data["curve"].items():
        for r in curve:
            p, w = r["push"], r["pipeline"]
            lag = w["policy_lag"]
            rows.append(f"| scale | {mode}, {r['workers']} pods ({link}): push s (last / median worker), registry "
                        f"egress in copies; env steps/s, fragments/s to the trainer, policy lag median / p95 | "
                        f"{p['push_seconds_median']} / {p['median_worker_seconds_median']}, {p['registry_egress_copies']}; "
                        f"{w['env_steps_per_second']}, {w['fragments_per_second_to_trainer']}, "
                        f"{lag['median']} / {lag['p95']} | |")
        by_n = {r["workers"]: r["push"]["push_seconds_median"] for r in curve}
        if 2 in by_n and max(by_n) > 2:
            top = max(by_n)
            ratio = by_n[top] / by_n[2]
            goal = f"≤ 1.5×: {'met' if ratio <= 1.5 else 'missed'}" if mode == "relay" else "(the star: ~N/2×)"
            rows.append(f"| scale | {mode}: push time at {top} pods over 2 pods | {ratio:.2f}× | {goal} |")
    churn = data.get("churn")
    if churn:
        accounting = churn.get("accounting", {})
        rows.append(f"| scale | churn: {churn['deleted']} of {churn['workers']} pods deleted during a push; survivors "
                    f"acknowledged / every pod on the version after s / fragments acknowledged = inserted | "
                    f"{churn['survivors_acked']} / {churn['every_worker_on_version_after_seconds']} / "
                    f"{accounting.get('fragments_acknowledged_to_workers')} = {accounting.get('fragments_inserted')} "
                    f"| {'exact' if accounting.get('exact') else 'not exact'} |")
    soak = data.get("soak")
    if soak:
        worst = max(soak["after_warmup"].items(), key=lambda kv: kv[1]["spread"], default=("", {"spread": 0}))
        stores = ", ".join(f"{k} {v['min']}–{v['max']}" for k, v in soak["stores"].items())
        rows.append(f"| scale | soak {soak['minutes']:g} min: largest spread of a service's RSS or open files after "
                    f"{soak['warmup_minutes']:g} min warm-up ({worst[0]}); stores | {worst[1]['spread']:.1%}; {stores} "
                    f"| ≤ 10%: {'met' if soak['within_10_percent'] else 'missed'} |")
    return rows


def headline_rows(name: str, data: dict[str, Any]) -> list[str]:
    if name == "scale":
        return scale_rows(data)
    if name == "gpu":
        return gpu_rows(data)
    if "tasks" in data:
        return learning_rows(name, data)
    if name == "registry":
        return [f"| registry | push to {data['workers']} workers at {size} vs one plain gRPC stream | "
                f"{s['ratio']:.2f}× ({s['ratio_to_keep']:.2f}× of receivers keeping the bytes) | "
                f"≤ 1.3×: {'met' if s['within_target'] else 'missed'} |" for size, s in data["summary"].items()
                ] + tls_rows(name, "push", data.get("tls", {}))
    if name == "rollout_worker":
        bare = data["bare_processes_2_envs_random_actions"]["env_steps_per_second"]
        return [f"| rollout_worker | {key}: fraction of bare env processes | {row['env_steps_per_second'] / bare:.2f} | "
                f"≥ {data['target_fraction_of_bare']} |"
                for key, row in data.items() if isinstance(row, dict) and key.startswith(("rollout_worker", "gym"))]
    if name == "replay_buffer":
        judged = ("worst_ratio_vs_raw", "worst_cpu_ratio_vs_raw")  # ingest and sample by reference
        return [f"| replay_buffer | Redis + S3 vs raw Redis + S3: {key} | {data[key]:.2f} | "
                f"{'≥ ' + str(data['target_ratio']) if key in judged else '(reported beside)'} |"
                for key in data if key.startswith("worst_") and isinstance(data[key], (int, float))
                ] + tls_rows(name, "ingest", {"1 front": data["tls_ingest"]} if "tls_ingest" in data else {})
    if name == "recovery":
        return [f"| recovery | {backend}: {service} killed -> first call answered / run going on (s) | "
                f"{row['first_call_seconds']} / {row['run_going_on_seconds']} | |"
                for backend, services in data["backends"].items() for service, row in services.items()]
    if name == "e2e":
        s, crafter = data["summary"], data.get("crafter_cow", {})
        return [f"| e2e | CartPole to a 100-episode mean of {data['target_return']:.0f}, wall seconds from process "
                f"start (median of seeds): Overworld vs Stable-Baselines3 (rl-zoo) | "
                f"{s['overworld_wall_seconds_to_target_median']} vs {s['sb3_wall_seconds_to_target_median']} "
                f"(ratio {s['wall_ratio_overworld_to_sb3']}) | ratio ≤ 1 |",
                f"| e2e | CartPole env steps to {data['target_return']:.0f} (median): Overworld vs SB3 | "
                f"{s['overworld_env_steps_to_target_median']} vs {s['sb3_env_steps_to_target_median']} | "
                f"Overworld ≤ 68k |",
                f"| e2e | seconds from `overworld run` to the first version swapped in at the workers / the "
                f"first update (median) | {s['startup_median']['first_version_swapped_in_at_workers']} / "
                f"{s['startup_median']['first_update']} | |",
                f"| e2e | Crafter cow: whole pipeline env steps/s while training vs 2 bare Crafter processes | "
                f"{crafter.get('env_steps_per_second_training')} vs "
                f"{crafter.get('bare_processes_2_env_steps_per_second')} ({crafter.get('pipeline_vs_bare')}) | |"]
    if name == "startup":
        return [f"| startup | {row['knob']}: seconds to Ray Train's first step | {row['first_train_step']} | |"
                for row in data["rows"]]
    if name == "trainer_memory":
        growth = data["peak_growth_mb_per_chain"]
        sizes = [row["chains"] for row in data["rows"]["iteration"]]
        return [f"| trainer_memory | {data['memory']} above the held memory, growth per extra chain, {sizes} chains "
                f"of VPT-2x: iteration / recomputation / recomputation as before | {growth['iteration']} / "
                f"{growth['recomputation_chunked']} / {growth['recomputation_whole_batch_before']} MB | flat |"]
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
    if (RESULTS / "scale.png").exists():
        lines += ["![Push time and fleet throughput against the number of rollout pods](scale.png)", ""]
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
