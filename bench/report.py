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
    """bench/gpu/check.py's one device call (bench/gpu/collect.py): each figure with the device, driver and
    torch it ran on; a step the call did not finish says how it ended."""
    def on(section: dict[str, Any]) -> str:
        o = section.get("on") or {}
        return f"{o.get('device')}, driver {o.get('driver')}, torch {o.get('torch')}"

    def unfinished(name: str, section: dict[str, Any]) -> str:
        return f"| gpu | {name} | {section.get('status')} | |"

    rows = []
    r = data.get("rollout", {})
    rows.append(f"| gpu | rollout worker, {r['num_envs']} Crafter envs in groups of {r['batch_size']}, the recipe's "
                f"ResNet: env steps/s with inference on CUDA vs on the CPU ({on(r)}) | "
                f"{r['rows']['cuda']['env_steps_per_second']:.0f} vs {r['rows']['cpu']['env_steps_per_second']:.0f} "
                f"({r['cuda_over_cpu']}×) | |" if r.get("status") == "ok" else unfinished("rollout", r))
    v = data.get("vpt2x", {})
    memory = v.get("max_memory_allocated_gib", v.get("peak_rss_gib"))
    rows.append(f"| gpu | one PPO iteration, VPT-2x stand-in ({v['parameters'] / 1e6:.1f} M), {v['chains_measured']} "
                f"of MineStudio's quick-start {v['settings']['chains']} chains x {v['settings']['steps_per_chain']} "
                f"steps, {v['settings']['autocast']}: samples/s, seconds, peak memory GiB ({on(v)}) | "
                f"{v['samples_per_second']}, {v['iteration_seconds']}, {memory} | |"
                if v.get("status") == "ok" and "samples_per_second" in v else
                unfinished("vpt2x", v if v.get("status") != "ok" else {"status": f"not measured: {v.get('not_measured')}"}))
    a = data.get("amp_fp16", {})
    rows.append(f"| gpu | use_amp fp16 + GradScaler: steps taken, scaler restored from the checkpoint ({on(a)}) | "
                f"{a['optimizer_steps'] - a['skipped_steps']:.0f} of {a['optimizer_steps']}, {a['scaler_restored']} | |"
                if a.get("status") == "ok" else unfinished("amp_fp16", a))
    c = data.get("crafter", {})
    if c.get("env_steps"):
        full = c.get("full_benchmark") or {}
        rows.append(f"| gpu | Crafter, {c['config']}, one call ({c.get('status')}): env steps, env steps/s, learner "
                    f"s/iteration, score so far ({on(c)}) | {c['env_steps']:,}, {c.get('env_steps_per_second')}, "
                    f"{c.get('learner_seconds_per_iteration')}, {c.get('score')} | |")
        rows.append(f"| gpu | Crafter benchmark ({full.get('seeds')} seeds x 1M env steps): calls like this one it "
                    f"would take at that rate | {full.get('calls')} ({full.get('env_steps_per_call'):,} env steps "
                    f"a call) | |" if full.get("calls") else unfinished("Crafter benchmark calls", full))
    else:
        rows.append(unfinished("crafter", c))
    return rows


def scale_rows(data: dict[str, Any], name: str = "scale") -> list[str]:
    """The scaling curve (bench/bench_scale.py): one row per weights push mode and fleet size, the
    relay's flatness against the goal, churn and the soak."""
    rows = []
    link = f"{data['weights_mb']:.0f} MB at {data['link_mbit']:.0f} Mbit/s"
    for mode, curve in data["curve"].items():
        for r in curve:
            p, w = r["push"], r["pipeline"]
            lag = w["policy_lag"]
            quiet = p.get("before")
            pushed = (f" (pushed with the host {quiet['host_idle']:.0%} idle, fleet at "
                      f"{quiet['fleet_env_steps_per_second']:g} steps/s)") if quiet else ""
            rows.append(f"| {name} | {mode}, {r['workers']} pods ({link}): push s (last / median worker){pushed}, registry "
                        f"egress in copies; env steps/s, fragments/s to the trainer, policy lag median / p95 | "
                        f"{p['push_seconds_median']} / {p['median_worker_seconds_median']}, {p['registry_egress_copies']}; "
                        f"{w['env_steps_per_second']}, {w['fragments_per_second_to_trainer']}, "
                        f"{lag['median']} / {lag['p95']} | |")
        by_n = {r["workers"]: r["push"]["push_seconds_median"] for r in curve}
        if 2 in by_n and max(by_n) > 2:
            top = max(by_n)
            ratio = by_n[top] / by_n[2]
            goal = f"≤ 1.5×: {'met' if ratio <= 1.5 else 'missed'}" if mode == "relay" else "(the star: ~N/2×)"
            rows.append(f"| {name} | {mode}: push time at {top} pods over 2 pods | {ratio:.2f}× | {goal} |")
    churn = data.get("churn")
    if churn:
        accounting = churn.get("accounting", {})
        rows.append(f"| {name} | churn: {churn['deleted']} of {churn['workers']} pods deleted during a push; survivors "
                    f"acknowledged / every pod on the version after s / fragments acknowledged = inserted | "
                    f"{churn['survivors_acked']} / {churn['every_worker_on_version_after_seconds']} / "
                    f"{accounting.get('fragments_acknowledged_to_workers')} = {accounting.get('fragments_inserted')} "
                    f"| {'exact' if accounting.get('exact') else 'not exact'} |")
    soak = data.get("soak")
    if soak:
        worst = max(soak["after_warmup"].items(), key=lambda kv: abs(kv[1]["spread"]), default=("", {"spread": 0}))
        stores = ", ".join(f"{k} {v['min']}–{v['max']}" for k, v in soak["stores"].items())
        rows.append(f"| {name} | soak {soak['minutes']:g} min: largest spread of a service's RSS or open files after "
                    f"{soak['warmup_minutes']:g} min warm-up ({worst[0]}); stores | {worst[1]['spread']:.1%}; {stores} "
                    f"| ≤ 10%: {'met' if soak['within_10_percent'] else 'missed'} |")
    return rows


def headline_rows(name: str, data: dict[str, Any]) -> list[str]:
    if name in ("scale", "scale_relay", "scale_soak", "scale_training"):
        return scale_rows(data, name)
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


# Results of code that has changed since they were measured: REPORT.md keeps them, with their date and why;
# the README shows only figures of the code as it is. A name leaves this list when its bench is run again.
SUPERSEDED = {
    "learning_crafter_cow": "before reservations, oldest-first sampling and room for episodes under way (2026-11-28)",
    "learning_crafter": "before reservations, oldest-first sampling and room for episodes under way (2026-11-28)",
    "scale": "its push curve is of the gRPC relay, replaced by the weights stream (scale_relay); its 32 pods "
             "while training ran before reservations (scale_training)",
    "scale_soak": "before reservations and leases changed the replay buffer and the workers (2026-11-28)",
}

README = Path(__file__).resolve().parents[1] / "README.md"
README_BEGIN = "<!-- results: generated by `python bench/report.py` from bench/results; edit those, not this -->"
README_END = "<!-- end of results -->"


def _at(data: dict[str, Any]) -> str:
    """The commit and day of a result; a bench of many runs kept across commits names the others too."""
    modified = "+" if data.get("tree_modified") else ""
    commit = str(data.get("commit", ""))[:7]
    others = sorted({str(c)[:7] for c in data.get("commits", [])} - {commit})
    also = f" (runs also at {', '.join(f'`{c}`' for c in others)})" if others else ""
    return f"`{commit}`{modified}, {str(data.get('date', ''))[:10]}{also}"


def readme_rows(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README's table of measured figures: the ones a reader compares, each with the commit and the
    day that measured it (a "+" after the commit: measured with changes on top of it); results of code
    that has changed since (SUPERSEDED) are left to REPORT.md."""
    results = {name: data for name, data in results.items() if name not in SUPERSEDED}
    rows = []
    add = rows.append
    if "e2e" in results:
        d = results["e2e"]
        s = d["summary"]
        add(f"| CartPole to a 100-episode mean of {d['target_return']:.0f}, every service vs Stable-Baselines3's PPO "
            f"(rl-zoo), the same seeds in one run: median wall seconds / env steps | "
            f"{s['overworld_wall_seconds_to_target_median']} s vs {s['sb3_wall_seconds_to_target_median']} s "
            f"(ratio {s['wall_ratio_overworld_to_sb3']}; goal ≤ 1); {s['overworld_env_steps_to_target_median']:,} "
            f"vs {s['sb3_env_steps_to_target_median']:,} | {_at(d)} |")
        crafter = d.get("crafter_cow") or {}
        if crafter.get("env_steps_per_second_training"):
            add(f"| Crafter cow task end to end (`examples/crafter_cow.yaml`, every service, the learner included): "
                f"env steps/s once training runs vs 2 bare Crafter processes stepping random actions on the same "
                f"cores; seconds from `overworld run` to the first update (CartPole, median) | "
                f"{crafter['env_steps_per_second_training']} vs {crafter['bare_processes_2_env_steps_per_second']} "
                f"({crafter['pipeline_vs_bare']}); {s['startup_median']['first_update']} s | {_at(d)} |")
    for name, label in (("learning_cartpole", "CartPole"), ("learning_crafter_cow", "Crafter cow task (cows per episode)")):
        if name in results:
            d = results[name]
            for entry in d["tasks"].values():
                seeds = entry["seeds"]
                values = ", ".join(f"{run.get('mean_return_last_100'):.1f}" for _, run in sorted(seeds.items()))
                steps = max(run.get("env_steps", 0) for run in seeds.values())
                baselines = ", ".join(f"{k.replace('_policy', '')} {v['mean_return']}" for k, v in entry.items()
                                      if isinstance(v, dict) and "mean_return" in v)
                add(f"| {label}: return of the last 100 episodes per seed, by {steps:,} env steps | {values} "
                    f"({baselines}) | {_at(d)} |")
    if "learning_crafter" in results:
        d = results["learning_crafter"]
        for task, entry in d["tasks"].items():
            if entry.get("crafter_score_mean") is None:
                continue
            best = entry.get("published_scores_at_1m_steps", {}).get("PPO (ResNet)")
            seeds = ", ".join(f"{((run.get('tasks') or {}).get(task) or {}).get('crafter', {}).get('score', 0):.1f}"
                              for _, run in sorted(entry["seeds"].items()))
            add(f"| Crafter benchmark score at 1M env steps (geometric mean of the 22 achievements' success rates), "
                f"`examples/crafter.yaml` | {entry['crafter_score_mean']:.1f} ± {entry['crafter_score_std']:.1f} "
                f"(seeds {seeds}; random 1.6, SB3 PPO 4.6, PPO with a ResNet {best} published) | {_at(d)} |")
    if "fleet_learning" in results:
        d = results["fleet_learning"]
        parts = []
        for key, c in d["configs"].items():
            if key.endswith("-reservations-off"):
                continue
            steps, used = c["env_steps_to_target"], c["env_steps_used"]
            reached = (f"{steps['median']:,.0f} ({steps['worst']:,.0f})" if steps["median"] is not None
                       else "not reached")
            parts.append(f"{key} {used['worst']:.1%}, {c['reached_target']}/{c['runs']} {reached}, "
                         f"{c['return_at_end']['worst']:.0f}, idle {c['idle_share']['median']:.0%}, lag "
                         f"{c['policy_lag_p50']['median']:g}/{c['policy_lag_p95']['worst']:g}")
        comparisons = d.get("comparisons", {})
        ratios = "; ".join(f"{k.split('_')[0]} over 1, {k.split('_')[3]}: {v}×"
                           for k, v in comparisons.items() if k.endswith("env_steps_to_target") and v is not None)
        add(f"| CartPole fleets (workers-weights), {max(c['runs'] for c in d['configs'].values())} runs each to "
            f"{d['budget_env_steps']:,} env steps (seeds 1-5, every other one beside a busy process per core): worst "
            f"share of env steps trained on; runs reaching {d['target_return']:.0f}, median (worst) env steps to it; "
            f"worst return at the end; median idle share; policy lag median / worst p95 | {'; '.join(parts)}. "
            f"Env steps to {d['target_return']:.0f}, the fleet's median over one worker's: {ratios} (goal ≤ 1.1×; "
            f"≥ 97% trained on) | {_at(d)} |")
        on, off = d["configs"].get("12-relay"), d["configs"].get("12-relay-reservations-off")
        if on and off:
            def ab(c: dict[str, Any]) -> str:
                steps = c["env_steps_to_target"]["median"]
                return (f"{c['env_steps_per_second']['median']:,.0f} env steps/s, {c['env_steps_used']['median']:.1%} "
                        f"trained on, {c['reached_target']}/{c['runs']} reach {d['target_return']:.0f}"
                        + (f" (median {steps:,.0f} env steps)" if steps else "")
                        + f", idle {c['idle_share']['median']:.0%}")
            add(f"| 12 CartPole workers, reservations on vs off (the same seeds; the learner is the bottleneck on 2 "
                f"cores: reservations idle the fleet rather than step what would be dropped) | on: {ab(on)}; off: "
                f"{ab(off)} | {_at(d)} |")
    if "reservations" in results:
        d = results["reservations"]
        on, off = d["median"]["on"], d["median"]["off"]
        add(f"| {d['workers']} Minecraft-paced workers ({d['workers'] * d['envs_per_worker']} envs at "
            f"{d['env_steps_per_second_per_env']} steps/s; the fleet is the bottleneck; {d.get('band_batches', 1)} "
            f"batches in flight), reservations on vs off, {len(d['runs']) // 2} seeds of "
            f"{d['budget_env_steps']:,} env steps: env steps/s (lost to reservations; goal ≤ 5%), idle share, share "
            f"trained on, worst (goal ≥ 97%) | {on['env_steps_per_second']:.0f} vs {off['env_steps_per_second']:.0f} "
            f"({d['env_steps_per_second_lost_to_reservations']:.1%})".replace("-0.0%", "0.0%")
            + f", {on['idle_share']:.1%} vs {off['idle_share']:.1%}, "
            f"{on['env_steps_used']:.1%} vs {off['env_steps_used']:.1%}, "
            f"{min(r['env_steps_used'] for r in d['runs'] if r['reservations']):.1%} | {_at(d)} |")
    if "crafter_used" in results:
        d = results["crafter_used"]
        cells = "; ".join(f"{r['workers']}-{r['mode']} {r['env_steps_used']:.1%} (idle {r['idle_share']:.0%}, lag "
                          f"{r['policy_lag_p50']:g}/{r['policy_lag_p95']:g}, {r['env_steps_per_second']:.0f} env steps/s)"
                          for r in d["runs"])
        add(f"| Crafter cow task (`{d['config']}`), fleets (workers-weights) to {d['budget_env_steps']:,} env steps: share "
            f"of env steps trained on (idle share, policy lag median / p95, env steps/s) | {cells} (goal ≥ 97%) "
            f"| {_at(d)} |")
    if "policy_lag" in results:
        d = results["policy_lag"]
        medians = d["median_env_steps_to_target"]
        lags = sorted({int(k.rsplit("lag", 1)[1]) for k in medians})
        cells = ", ".join(f"{lag}: {medians[f'ppo-lag{lag}']:,.0f}"
                          + (f" / {medians[f'decoupled-lag{lag}']:,.0f}" if f"decoupled-lag{lag}" in medians else "")
                          for lag in lags)
        add(f"| PPO on CartPole (one process, examples/cartpole.yaml's settings) fed data k versions old, "
            f"{len(d['seeds'])} seeds: median env steps to {d['target_return']:.0f} by k, PPO's ratio to the "
            f"behaviour policy / the decoupled objective | {cells} | {_at(d)} |")
    if "preemption" in results:
        d = results["preemption"]

        def worst(rows: list[dict[str, Any]], key: str) -> Any:
            return max(r[key] for r in rows)

        cells = "; ".join(
            f"{r['grace_seconds']} s: {worst(r['worker_preemptions'], 'env_steps_thrown_away')} / "
            f"{worst(r['worker_preemptions'], 'seconds_to_go')} / {worst(r['worker_preemptions'], 'seconds_until_fleet_back')}"
            f" / {worst(r['worker_preemptions'], 'seconds_until_a_newer_version')} s "
            f"({len(r['worker_preemptions'])} workers); trainer {r['trainer_preemption']['iterations_lost']} / "
            f"{r['trainer_preemption']['seconds_until_a_newer_version']} s; "
            + "".join(f"{f['front']} {sum(f['failed_calls_seen_by_the_fleet'].values())} / "
                      f"{sum(f['attempts_the_fleet_made_again'].values())} / {f['seconds_until_ready_again']} s; "
                      for f in r.get("front_preemptions", []))
            + f"{'nothing' if r['ledger']['nothing_acknowledged_lost'] else 'SOME'} acknowledged lost "
            f"({r['ledger']['acknowledged']} fragments)" for r in d["runs"])
        add(f"| Preemptions in the cluster rehearsal ({d['workers']} CartPole workers at {d['step_ms']:g} ms a step), "
            f"pods deleted with the spot node's grace period: per rollout worker, worst env steps thrown away / "
            f"seconds to go / until its replacement holds a lease / until a newer version; per trainer (the Ray "
            f"head), iterations lost / seconds until a newer version; per front (one pod deleted), calls the fleet saw "
            f"fail / attempts it made again / seconds until ready again; the fleet's ledger | {cells} | {_at(d)} |")
    if "autoscaling" in results:
        d = results["autoscaling"]
        o, st = d["outcome"], d["settings"]
        add(f"| Rollout fleet sized by the HPA (the chart's KEDA ScaledObject, the HPA's algorithm on the rehearsal's "
            f"Prometheus; sync {st['sync_seconds']:g} s, windows {st['scale_up_window_seconds']}/"
            f"{st['scale_down_window_seconds']} s, shortened), CartPole at {st['step_ms']:g} ms per step, from 1 "
            f"worker for {d['samples'][-1]['seconds'] / 60:.0f} min: replicas at the end (largest); scalings (in the "
            f"last third); last third's learner wait share, fleet idle share, env steps/s; return first → last | "
            f"{o['replicas_at_end']} ({o['largest']}); {o['scalings']} ({o['scalings_in_the_last_third']}); "
            f"{o['learner_wait_share_last_third']}, {o['fleet_idle_share_last_third']}, "
            f"{o['env_steps_per_second_last_third']}; {o['return_first']} → {o['return_last']} | {_at(d)} |")
    if "relay" in results:
        d = results["relay"]
        w = d["worker_cpu_seconds_per_gb"]
        worst = max(r["registry_cpu_seconds"] for r in d["rounds"]) / (d["size_bytes"] / 1e9)
        add(f"| Weights relay, {d['size_bytes'] / 2**20:.0f} MB versions, mutual TLS, {d['workers']} relaying workers: "
            f"CPU-s per GB of a relaying worker (receive, check, pass on, swap in) median (worst); the registry per GB "
            f"it sends; the registry per GB of a version, median (worst round): the trainer's publish over the "
            f"weights stream, its sha256, the blob write, sending | {w['median']:.2f} "
            f"({w['max']:.2f}); {d['registry_sending_cpu_seconds_per_gb_sent']:.2f}; "
            f"{d['registry_cpu_seconds_per_gb_of_version']:.2f} ({worst:.2f}) (goal ≤ 2 each) | {_at(d)} |")
    if "scale" in results:
        d = results["scale"]
        curve = {mode: {r["workers"]: r for r in rows_} for mode, rows_ in d["curve"].items()}
        relay, star = curve.get("relay", {}), curve.get("star", {})
        if relay and star and 2 in relay and 2 in star:
            top = max(relay)
            r2, rt = relay[2]["push"]["push_seconds_median"], relay[top]["push"]["push_seconds_median"]
            s2, st = star[2]["push"]["push_seconds_median"], star[top]["push"]["push_seconds_median"]
            training = relay[top]["pipeline"]
            add(f"| Weights push, {d['weights_mb']:.0f} MB on {d['link_mbit']:.0f} Mbit/s links (the scale "
                f"rehearsal), publish → last worker swapped in, 2 → {top} rollout pods, trainer idle | relay {r2:.1f} → "
                f"{rt:.1f} s ({rt / r2:.2f}×; goal ≤ 1.5×), registry sends "
                f"{relay[top]['push']['registry_egress_copies']:.1f} copies; star {s2:.1f} → {st:.1f} s ({st / s2:.1f}×), "
                f"{star[top]['push']['registry_egress_copies']:.0f} copies; while training at {top} pods, relay median "
                f"{training['push_seconds_median']:.1f} s, worst {training['push_seconds_max']:.1f} s | {_at(d)} |")
            w = relay[top]["pipeline"]
            add(f"| {top} Minecraft-paced rollout pods (20 steps/s each) while training, weights by relay: fleet env "
                f"steps/s, fragments/s to the trainer, policy lag median / p95 (versions) | {w['env_steps_per_second']}, "
                f"{w['fragments_per_second_to_trainer']}, {w['policy_lag']['median']} / {w['policy_lag']['p95']} "
                f"| {_at(d)} |")
        # a later soak-only run (`--sizes 32 --soak-minutes 30`) is kept apart from the curve, and wins
        d = results.get("scale_soak", d)
        if d.get("soak"):
            soak = d["soak"]
            drifts = soak["after_warmup"]
            every_pod = any("rollout-worker" in key for key in drifts)
            over = ("every pod (rollout pods and pods replaced meanwhile included)" if every_pod
                    else "the service and store pods (this run did not sample the rollout pods)")

            def largest(keys: list[str]) -> str:
                key = max(keys, key=lambda k: abs(drifts[k]["spread"]), default=None)
                return f"{drifts[key]['spread']:+.1%} ({key})" if key else "none"

            # the stores are stand-ins of the rehearsal's own (Redis, moto for SeaweedFS), not Overworld
            ours = [k for k in drifts if not any(store in k for store in ("-redis-", "-seaweedfs-"))]
            add(f"| Soak, {soak['minutes']:g} min of the largest fleet: largest drift of a pod's memory or open "
                f"files after warm-up, over {over}; of Overworld's own pods (the stores' stand-ins left out) | "
                f"{largest(list(drifts))}; {largest(ours)} (goal within ±10%) | {_at(d)} |")
    if "scale_training" in results:
        d = results["scale_training"]
        relay = {r["workers"]: r for r in d["curve"]["relay"]}
        top = max(relay)
        w = relay[top]["pipeline"]
        add(f"| {top} Minecraft-paced rollout pods (20 steps/s each) while training, weights by relay (the scale "
            f"rehearsal, {d['link_mbit']:.0f} Mbit/s links): fleet env steps/s, fragments/s to the trainer, policy lag "
            f"median / p95 (versions) | {w['env_steps_per_second']}, {w['fragments_per_second_to_trainer']}, "
            f"{w['policy_lag']['median']} / {w['policy_lag']['p95']} (was 142.0 before reservations) | {_at(d)} |")
    if "scale_relay" in results:
        d = results["scale_relay"]
        relay = {r["workers"]: r for r in d["curve"]["relay"]}
        top = max(relay)
        r2, rt = relay[2]["push"]["push_seconds_median"], relay[top]["push"]["push_seconds_median"]
        load = d["load_average_beside"]
        add(f"| Weights push by the stream relay, {d['weights_mb']:.0f} MB on {d['link_mbit']:.0f} Mbit/s links, "
            f"publish → last worker swapped in, 2 → {top} rollout pods, trainer idle (`{d['command'].split(' --work')[0]}`"
            f", load average {load['min']:.0f}–{load['max']:.0f} beside it) | {r2:.1f} → {rt:.1f} s ({rt / r2:.2f}×; "
            f"goal ≤ 1.5×), registry sends {relay[top]['push']['registry_egress_copies']:.1f} copies | {_at(d)} |")
    if "registry" in results:
        d = results["registry"]
        ratios = "; ".join(f"{size} {v['ratio']:.2f}×" for size, v in d["summary"].items())
        tls = "; ".join(f"{size} {v['throughput_cost']:.0%}" for size, v in (d.get("tls") or {}).items())
        add(f"| Registry push to {d['workers']} worker processes on one machine (star, no links) vs one plain "
            f"gRPC stream | {ratios} (goal ≤ 1.3×); mutual TLS costs {tls} of throughput | {_at(d)} |")
    if "replay_buffer" in results:
        d = results["replay_buffer"]
        add(f"| Replay buffer on Redis + S3 vs raw Redis + S3 (ingest, sample by reference), worst case, plaintext | "
            f"{d['worst_ratio_vs_raw']:.2f} by throughput, {d['worst_cpu_ratio_vs_raw']:.2f} by CPU (goal ≥ "
            f"{d['target_ratio']}) | {_at(d)} |")
    if "rollout_worker" in results:
        d = results["rollout_worker"]
        bare = d["bare_processes_2_envs_random_actions"]["env_steps_per_second"]
        tiny = max(v["env_steps_per_second"] for k, v in d.items() if k.startswith("rollout_worker_") and "tiny" in k)
        crafter = d.get("rollout_worker_16_envs_crafter_cow_cnn", {}).get("env_steps_per_second")
        add(f"| Rollout worker on Crafter, 2 env processes, vs the bare env processes: a tiny CNN / the Crafter cow "
            f"task's CNN | {tiny / bare:.2f} / {crafter / bare:.2f} (goal ≥ {d['target_fraction_of_bare']}) "
            f"| {_at(d)} |")
    if "recovery" in results:
        d = results["recovery"]
        worst = max(((backend, service, row) for backend, services in d["backends"].items()
                     for service, row in services.items()), key=lambda t: t[2]["run_going_on_seconds"])
        add(f"| Recovery of each service killed while training (CartPole, both backends): slowest to train on again "
            f"| {worst[1]} on {worst[0]}: first call {worst[2]['first_call_seconds']} s, training on after "
            f"{worst[2]['run_going_on_seconds']} s | {_at(d)} |")
    if "trainer_memory" in results:
        d = results["trainer_memory"]
        growth = d["peak_growth_mb_per_chain"]
        add(f"| Trainer memory per extra chain of VPT-2x, one iteration | {growth['iteration']} MB (was "
            f"{growth['recomputation_whole_batch_before']} MB before chunked recomputation) | {_at(d)} |")
    if "gpu" in results:
        d = results["gpu"]
        r, v, c = d.get("rollout", {}), d.get("vpt2x", {}), d.get("crafter", {})
        on = (d.get("probe") or {}).get("on") or {}
        done = [f"rollout inference CUDA vs CPU {r['rows']['cuda']['env_steps_per_second']:.0f} vs "
                f"{r['rows']['cpu']['env_steps_per_second']:.0f} env steps/s" if r.get("status") == "ok" else
                f"rollout {r.get('status')}",
                f"VPT-2x PPO iteration in bf16 {v['samples_per_second']} samples/s"
                if v.get("status") == "ok" and "samples_per_second" in v else f"VPT-2x {v.get('status')}",
                f"fp16 + GradScaler {'ok' if d.get('amp_fp16', {}).get('status') == 'ok' else d.get('amp_fp16', {}).get('status')}"]
        add(f"| The GPU check, one device call on {on.get('device')} (torch {on.get('torch')}) | {'; '.join(done)} "
            f"| {_at(d)} |")
        if c.get("env_steps"):
            calls = (c.get("full_benchmark") or {}).get("calls")
            add(f"| Crafter recipe (`{c['config']}`) in that call: env steps/s, learner s/iteration, score after "
                f"{c['env_steps']:,} env steps; calls the full benchmark (3 seeds × 1M) would take | "
                f"{c.get('env_steps_per_second')}, {c.get('learner_seconds_per_iteration')}, {c.get('score')}; "
                f"{calls} | {_at(d)} |")
    return ["| what | measured | measured at |", "|---|---|---|", *rows]


def readme_block(results: dict[str, dict[str, Any]]) -> str:
    return "\n".join([README_BEGIN, *readme_rows(results), README_END])


def write_readme(results: dict[str, dict[str, Any]]) -> None:
    text = README.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"README.md has no results block ({README_BEGIN!r} ... {README_END!r})")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    README.write_text(head + readme_block(results) + tail)


def load() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}


def main() -> None:
    results = load()
    lines = ["# Benchmark results", "", "## Headlines", "", "| bench | what | measured | target |", "|---|---|---|---|"]
    for name, data in results.items():
        try:
            lines += headline_rows(name, data)
        except (KeyError, TypeError, ValueError) as err:  # an older result layout: its numbers are below
            lines.append(f"| {name} | (no headline: {type(err).__name__} {err}) | | |")
    lines.append("")
    older = [f"| {name} | {_at(results[name])} | {why} |" for name, why in SUPERSEDED.items() if name in results]
    if older:
        lines += ["## Results of code that has changed since", "",
                  "Kept for the record, left out of the README: what they measured has changed since.", "",
                  "| result | measured at | why it is out of date |", "|---|---|---|", *older, ""]
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
    write_readme(results)
    print(text)


if __name__ == "__main__":
    main()
