"""The scaling model of docs/operations.md ("Scale"), computed from bench/results/scale.json: each
service's cost per rollout pod and per fragment, measured on the scale rehearsal, extrapolated to
256 and 1,024 pods with a 1 GB model at 10 and 25 Gbit/s, and which part saturates first.

    python bench/scale_model.py     # prints it and writes it into docs/operations.md (make scale runs it)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SERVICES = ("model-registry", "rollout-manager", "replay-buffer", "gae", "redis", "object-store", "trainer")
WORKER_CORES = 4  # the chart's rollout-worker CPU request
REGISTRY_CORES = 2  # what a registry pod can use while it sends (its request is 0.5)
MODEL_GB = 1.0
PODS = (256, 1024)
LINKS_GBIT = (10, 25)


def relay_push_seconds(pods: int, gbit: float, data: dict[str, Any], fanout: int = 2) -> float:
    """The trainer's upload to the registry, then one copy's transfer at the lowest of the link's rate, the
    rate a worker's CPU passes bytes on and the rate the registry's CPU sends them, plus a message's
    transfer per level of the stripe trees."""
    relay = data["curve"]["relay"][-1]["push"]
    link = gbit / 8  # GB/s
    worker = WORKER_CORES / relay["worker_cpu_seconds_per_gb"] if relay["worker_cpu_seconds_per_gb"] > 0 else link
    registry = REGISTRY_CORES / relay["registry_cpu_seconds_per_gb"] if relay["registry_cpu_seconds_per_gb"] > 0 else link
    rate = min(link, worker, registry)
    chunk_gb = 512 / 1024**2
    levels = math.ceil(math.log(max(pods / fanout, 1), fanout)) + 2
    return MODEL_GB / link + MODEL_GB / rate + levels * chunk_gb / (link / fanout)


RELAY_MESSAGE_MB = 0.5  # the relay plan's chunk_bytes for versions up to 2 GB


def copy_seconds(data: dict[str, Any]) -> float:
    """One copy of the version over one of the rehearsal's links."""
    return data["weights_mb"] / (data["link_mbit"] / 8)


def fixed_seconds(data: dict[str, Any]) -> float:
    """What a version costs besides its transfers and CPU (announce, plan, acknowledgements), taken from
    the smallest relay fleet: its push less the trainer's upload and one copy to the worker."""
    smallest = data["curve"]["relay"][0]["push"]
    return max(0.0, smallest["push_seconds_median"] - 2 * copy_seconds(data))


def predicted_push_seconds(data: dict[str, Any], mode: str, row: dict[str, Any]) -> float:
    """Publish -> the last worker swapped in, on the rehearsal (every pod on one machine of `cpus` cores):
    the trainer's upload to the registry, then whichever takes longer of the transfers (star: the
    registry's link carries a copy per pod; relay: one copy, plus a message per level of the stripe
    trees) and the CPU all parties spend on the version (each worker's and the registry's measured CPU
    per GB) shared by the machine's cores; plus the fixed cost of a version."""
    pods, push = row["workers"], row["push"]
    gb = push["size_mb"] / 1024
    copy = copy_seconds(data)
    if mode == "star":
        links = pods * copy
    else:
        levels = math.ceil(math.log(max(pods, 2), 2))
        links = copy + levels * RELAY_MESSAGE_MB / (data["link_mbit"] / 8)
    cpu = (pods * push["worker_cpu_seconds_per_gb"] + push["registry_cpu_seconds_per_gb"]) * gb / data["cpus"]
    return fixed_seconds(data) + copy + max(links, cpu)


def push_predictions(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each measured push beside the model's prediction for it."""
    out = []
    for mode, rows in data["curve"].items():
        for row in rows:
            measured = row["push"]["push_seconds_median"]
            predicted = predicted_push_seconds(data, mode, row)
            out.append({"mode": mode, "pods": row["workers"], "measured": measured, "predicted": round(predicted, 2),
                        "error": round(predicted / measured - 1, 3)})
    return out


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
              f"on, sha256, swap in; measured once the pods left the cores half idle) and the registry "
              f"{push['registry_cpu_seconds_per_gb']:.2f} CPU-s per GB, whatever the fleet's size (the registry "
              f"sends {push['registry_egress_copies']:.1f} copies by relay).", "",
              f"Extrapolated to a {MODEL_GB:.0f} GB model (VPT-2x in fp32) with {WORKER_CORES}-core worker pods:", "",
              "| pods | link | star: push (upload + the registry sends N copies) | relay: push (upload + one copy + a "
              "message per level; the worker's and the registry's CPU cap the rate) | registry egress, star / relay |",
              "|---|---|---|---|---|"]
    for pods in PODS:
        for gbit in LINKS_GBIT:
            star = (pods + 1) * MODEL_GB / (gbit / 8)
            lines.append(f"| {pods} | {gbit} Gbit/s | {star:.0f} s | {relay_push_seconds(pods, gbit, data):.1f} s | "
                         f"{pods * MODEL_GB:.0f} GB / {MODEL_GB:.0f} GB |")
    lines += ["", "The same model on the rehearsal itself, where every pod shares one machine of "
              f"{data['cpus']} cores: push = the trainer's upload ({copy_seconds(data):.2f} s a copy on these links) + "
              "max(the copies the registry's link carries, or one copy and a message per tree level; the CPU of "
              "every worker and the registry per GB, shared by the cores) + the fixed cost of a version "
              f"({fixed_seconds(data):.2f} s, from the 1-pod relay run), against every measured size:", "",
              "| mode | pods | measured push | predicted | error |", "|---|---|---|---|---|"]
    for p in push_predictions(data):
        lines.append(f"| {p['mode']} | {p['pods']} | {p['measured']:.1f} s | {p['predicted']:.1f} s | "
                     f"{p['error']:+.0%} |")
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


OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
BEGIN = "<!-- scale model: generated by `python bench/scale_model.py` from bench/results/scale.json -->"
END = "<!-- end of scale model -->"


def block(data: dict[str, Any]) -> str:
    return f"{BEGIN}\n{model(data)}\n{END}"


def main() -> None:
    """Print the model and write it into docs/operations.md."""
    data = json.loads((RESULTS / "scale.json").read_text())
    text = OPERATIONS.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    OPERATIONS.write_text(head + block(data) + tail)
    print(model(data))


if __name__ == "__main__":
    main()
