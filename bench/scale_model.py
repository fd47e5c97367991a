"""The scaling model of docs/operations.md ("Scale"), computed from bench/results/scale.json: each
service's cost per rollout pod and per fragment, measured on the scale rehearsal, extrapolated to
256 and 1,024 pods with a 1 GB model at 10 and 25 Gbit/s, and which part saturates first.

    python bench/scale_model.py            # prints the markdown that docs/operations.md carries
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SERVICES = ("model-registry", "rollout-manager", "replay-buffer", "gae", "redis", "object-store", "trainer")
WORKER_CORES = 4  # the chart's rollout-worker CPU request
MODEL_GB = 1.0
PODS = (256, 1024)
LINKS_GBIT = (10, 25)


def relay_push_seconds(pods: int, gbit: float, data: dict[str, Any], fanout: int = 2) -> float:
    """One copy's transfer (at the link's rate, or the rate a worker's CPU passes bytes on, whichever is
    lower), plus a message's transfer per level of the stripe trees."""
    relay = data["curve"]["relay"][-1]["push"]
    link = gbit / 8  # GB/s
    cpu = WORKER_CORES / relay["worker_cpu_seconds_per_gb"] if relay["worker_cpu_seconds_per_gb"] > 0 else link
    rate = min(link, cpu)
    chunk_gb = 512 / 1024**2
    levels = math.ceil(math.log(max(pods / fanout, 1), fanout)) + 2
    return MODEL_GB / rate + levels * chunk_gb / (link / fanout)


def model(data: dict[str, Any]) -> str:
    relay_rows = data["curve"]["relay"]
    top = relay_rows[-1]
    n = top["workers"]
    window = top["pipeline"]
    frames_per_s = window["env_steps_per_second"]
    fragments_per_s = frames_per_s / 32
    lines = [f"Measured at {n} rollout pods on the scale rehearsal ({data['weights_mb']:.0f} MB of weights, "
             f"{data['link_mbit']:.0f} Mbit/s links; each pod one Minecraft-paced env at 20 steps/s, 64x64 frames, "
             f"32-step fragments: {frames_per_s:.0f} env steps/s, {fragments_per_s:.1f} fragments/s in all):", "",
             "| service | CPU s/s at N | per pod | per 1,000 fragments/s | PSS MB at N | per pod |", "|---|---|---|---|---|---|"]
    per_pod: dict[str, float] = {}
    for name in (*SERVICES, "rollout-worker"):
        c = window["cost"].get(name)
        if not c:
            continue
        per_pod[name] = c["cpu_per_second"] / n
        lines.append(f"| {name} | {c['cpu_per_second']:.3f} | {c['cpu_per_second'] / n:.4f} | "
                     f"{1000 * c['cpu_per_second'] / max(fragments_per_s, 1e-9):.1f} | {c['pss_mb']:.0f} | "
                     f"{c['pss_mb'] / n:.1f} |")
    push = top["push"]
    lines += ["", f"A version costs each worker {push['worker_cpu_seconds_per_gb']:.2f} CPU-s per GB (receive, pass "
              f"on, sha256, swap in; its env and inference run meanwhile) and the registry "
              f"{push['registry_cpu_seconds_per_gb']:.2f} CPU-s per GB, whatever the fleet's size (the registry "
              f"sends {push['registry_egress_copies']:.1f} copies by relay).", "",
              f"Extrapolated to a {MODEL_GB:.0f} GB model (VPT-2x in fp32) with {WORKER_CORES}-core worker pods:", "",
              "| pods | link | star: push (registry sends N copies) | relay: push (one copy + a message per level; "
              "the worker's CPU caps the rate) | registry egress, star / relay |", "|---|---|---|---|---|"]
    for pods in PODS:
        for gbit in LINKS_GBIT:
            star = pods * MODEL_GB / (gbit / 8)
            lines.append(f"| {pods} | {gbit} Gbit/s | {star:.0f} s | {relay_push_seconds(pods, gbit, data):.1f} s | "
                         f"{pods * MODEL_GB:.0f} GB / {MODEL_GB:.0f} GB |")
    lines += ["", "The data path grows with the fleet (per pod, as measured; a pod with more envs or larger "
              "frames scales these by its fragments/s):", "",
              "| pods | replay fronts, CPU cores | Redis, CPU cores (one thread) | rollout-manager, CPU cores "
              "(one replica) | object store, CPU cores |", "|---|---|---|---|---|"]
    for pods in (n, *PODS):
        lines.append(f"| {pods} | {per_pod.get('replay-buffer', 0) * pods:.2f} | {per_pod.get('redis', 0) * pods:.2f} | "
                     f"{per_pod.get('rollout-manager', 0) * pods:.2f} | {per_pod.get('object-store', 0) * pods:.2f} |")
    single = {k: 1.0 / v for k, v in per_pod.items() if k in ("redis", "rollout-manager") and v > 0}
    if single:
        first = min(single, key=lambda k: single[k])
        lines += ["", "Single-replica parts saturate one core at: " + ", ".join(
            f"{k} ~{v:,.0f} pods" for k, v in sorted(single.items(), key=lambda kv: kv[1])) +
            f"; the first is {first}."]
    return "\n".join(lines)


def main() -> None:
    print(model(json.loads((RESULTS / "scale.json").read_text())))


if __name__ == "__main__":
    main()
