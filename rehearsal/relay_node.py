"""The processes of the relay's link test (tests/rehearsal/test_relay_links.py), each run in a network
namespace of its own:

    relay_node.py watcher REGISTRY NAME DIR     a rollout worker's weights path: its relay (the weights
                                                stream) and WeightsWatcher; every version it swaps in
                                                is appended to DIR/NAME.versions ("version checksum"), and
                                                DIR/NAME.status holds the bytes it has relayed
    relay_node.py publish REGISTRY METRICS VERSION   publish a version (as the trainer), wait for its push,
                                                print {push_seconds, egress_bytes, acked, watchers, complete}
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import torch


def model(version: int) -> dict[str, torch.Tensor]:
    """8 MB: one tensor of many relay messages, and a small one."""
    return {"w": torch.full((2_000_000,), float(version)) + torch.arange(2_000_000) / 1e6,
            "b": torch.full((64,), -float(version), dtype=torch.float64)}


def checksum(state: dict[str, torch.Tensor]) -> str:
    return f"{float(state['w'].double().sum()):.6f}:{float(state['b'].sum()):.3f}"


def watcher(registry: str, name: str, out: Path) -> None:
    from prometheus_client import REGISTRY

    from overworld.model_registry.worker.relay import RelayShelf, serve_relay
    from overworld.model_registry.worker.watcher import WeightsWatcher

    shelf = RelayShelf()
    relay = serve_relay(shelf, "0.0.0.0", 50066)
    current = {k: torch.zeros_like(v) for k, v in model(0).items()}
    watch = WeightsWatcher(registry, name, current, relay_port=relay.port, shelf=shelf)
    status = out / f"{name}.status"
    while True:
        got = watch.take()
        if got is not None:
            version, state = got
            for k, v in state.items():
                current[k].copy_(v)
            with (out / f"{name}.versions").open("a") as f:
                f.write(f"{version} {checksum(current)}\n")
            watch.ack(version)
        served = REGISTRY.get_sample_value("overworld_relay_bytes_served_total") or 0.0
        reattaches = sum(REGISTRY.get_sample_value("overworld_relay_reattaches_total", {"reason": r}) or 0.0
                         for r in ("broken", "stalled", "bad"))
        status.with_suffix(".tmp").write_text(json.dumps({"served": served, "reattaches": reattaches}))
        status.with_suffix(".tmp").replace(status)
        time.sleep(0.02)


def pushed_bytes(metrics: str) -> float:
    """The registry's egress so far (waiting for a registry that is still starting)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
                text = response.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    for line in text.splitlines():
        if line.startswith("overworld_registry_bytes_pushed_total "):
            return float(line.split()[1])
    return 0.0


def publish(registry: str, metrics: str, version: int) -> None:
    from overworld.core.wire import weights
    from overworld.model_registry.client import ModelRegistryClient

    client = ModelRegistryClient(registry)
    before = pushed_bytes(metrics)
    data = weights.to_bytes(model(version))
    client.publish(version, data)
    status = client.push_status(version, wait=120)
    print(json.dumps({"push_seconds": status.push_seconds, "egress_bytes": pushed_bytes(metrics) - before,
                      "size": len(data), "acked": status.acked, "watchers": status.watchers,
                      "complete": status.complete}))


if __name__ == "__main__":
    if sys.argv[1] == "watcher":
        watcher(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    elif sys.argv[1] == "publish":
        publish(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
    os._exit(0)
