"""What the weights relay costs each role in CPU, per GB, under mutual TLS (issue 29: a relaying worker
<= 2 CPU-s per GB it receives, checks, passes on and swaps in; the registry <= 2 per GB it sends).

A registry process (`python -m overworld.model_registry`, relay fan-out 2) and --workers worker
processes, each a rollout worker's weights path without environments: its relay and the real
WeightsWatcher, and a loop that copies each version taken into its model tensors (load_state_dict's
copy) and acknowledges it. Every process has its identity's certificate of one run's CA. The driver
publishes versions of --size-mb (a distinct payload each) one after another, as the trainer does,
and reads each process's CPU time (user + system, all threads, from /proc) before and after each push:

- worker: CPU-s per GB of the version, per worker (each receives one copy and passes on at most one);
- registry, sending: its CPU-s while the driver fetches the last version --fetches times, as a relaying
  worker fetches a stripe (the weights stream; a tree without it: Fetch with the relay's chunk size),
  per GB sent;
- registry, whole: all of its CPU-s per push, per GB of the version, and what a publish costs it with
  nobody watching (receiving the Publish over gRPC, its sha256, the blob write), both for the record.

Medians over --rounds pushes after one warm-up push (which pays the first touch of every buffer).
Results: bench/results/relay.json. `--services DIR` measures another checkout's code (e.g. a worktree
of the commit before, for the before/after figures; its worker processes then use that tree's relay
API).

    python -m bench.bench_relay [--workers 4] [--size-mb 256] [--rounds 5] [--services DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_main(registry: str, worker_id: str) -> None:
    """One worker's weights path: relay + WeightsWatcher + a loop that swaps by copy."""
    import threading

    import torch

    from overworld.model_registry.worker.relay import RelayShelf
    from overworld.model_registry.worker.watcher import WeightsWatcher

    torch.set_num_threads(1)
    shelf = RelayShelf()
    relay: Any
    try:
        from overworld.model_registry.worker.relay import serve_relay
        relay = serve_relay(shelf)
    except ImportError:  # a tree from before the weights stream: the relay was the gRPC FetchWeights
        from overworld.core.grpc_util import serve
        from overworld.rollout_worker.process import WorkerService, add_to_server  # type: ignore[attr-defined]

        relay = serve([(add_to_server, WorkerService(shelf, threading.Event()),  # type: ignore[call-arg]
                        "overworld.v1.RolloutWorker")])
    watcher = WeightsWatcher(registry, worker_id, {}, relay_port=relay.port, shelf=shelf)
    model: dict[str, torch.Tensor] = {}
    while True:
        got = watcher.take()
        if got is not None:
            version, state = got
            if set(model) != set(state) or any(model[k].shape != v.shape for k, v in state.items()):
                model = {k: torch.empty_like(v) for k, v in state.items()}
            with torch.no_grad():
                for k, v in state.items():
                    model[k].copy_(v)
            del state, got
            watcher.ack(version)
        time.sleep(0.02)


def payload(size: int, seed: int) -> bytes:
    import torch

    from overworld.core.wire.weights import to_bytes

    n = 8
    gen = torch.Generator().manual_seed(seed)
    return to_bytes({f"layer{i}.weight": torch.rand(size // 4 // n, generator=gen) for i in range(n)})


def pushed_bytes(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("overworld_registry_bytes_pushed_total "):
                return float(line.split()[1])
    return 0.0


def fetch_as_a_relay_does(address: str, version: int, size: int, identity: Path) -> int:
    """The whole of `version` from the registry, as a relaying worker fetches a stripe; bytes received."""
    from overworld.core.security import tls
    from overworld.model_registry.client import ModelRegistryClient
    from overworld.model_registry.relay_plan import relay_chunk_bytes
    from overworld.v1 import model_registry_pb2 as pb

    tls.use(identity)
    client = ModelRegistryClient(address)
    try:
        watch = client.watch("bench-driver", known_version=0)  # the first announcement: where and how
        announcement = next(iter(watch))
        watch.cancel()
        chunk = announcement.chunk_bytes or relay_chunk_bytes(size)
        if not announcement.weights_port:  # a tree from before the weights stream: gRPC Fetch
            return len(client.fetch(version, verify=False, timeout=300)[1])
        request = pb.FetchRequest(version=version, limit=size, chunk_size=chunk)
        from overworld.model_registry.stream.protocol import END, open_stream

        out = bytearray(chunk)
        stream = open_stream(f"{address.rpartition(':')[0]}:{announcement.weights_port}", request, 30.0, 60.0,
                             lambda: False, "model-registry")
        received = 0
        try:
            while (frame := stream.next(lambda i, n: memoryview(out)[:n])).kind != END:
                received += frame.length
        finally:
            stream.close()
        return received
    finally:
        client.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(args: argparse.Namespace, services: Path) -> dict[str, Any]:
    from overworld.core.security import tls
    from overworld.model_registry.client import ModelRegistryClient

    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update({"PYTHONPATH": f"{services}:{ROOT}", "OVERWORLD_LOG_FORMAT": "text", "OVERWORLD_LOG_LEVEL": "WARNING"})
    size = int(args.size_mb * (1 << 20))
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="bench-relay-") as tmp:
        identities = tls.write_run_credentials(Path(tmp, "tls"), "bench-relay")
        port, metrics = free_port(), free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "overworld.model_registry", "--port", str(port), "--metrics-port", str(metrics),
             "--blobs", f"{tmp}/blobs", "--retain", "2", "--registry-relay-fanout", str(args.fanout)],
            env={**env, "OVERWORLD_TLS_DIR": str(identities["model-registry"])}))
        registry_pid = procs[0].pid
        address = f"127.0.0.1:{port}"
        tls.use(identities["trainer"])  # the driver publishes, as the trainer does
        client = ModelRegistryClient(address)
        try:
            version = 0

            def publish() -> tuple[float, float]:
                """Publish the next version; (the registry's CPU-s, bytes it pushed) until its push completed."""
                nonlocal version
                version += 1
                data = payload(size, version)
                cpu0, sent0 = cpu_seconds(registry_pid), pushed_bytes(metrics)
                client.publish(version, data, parent=version - 1)
                status = client.push_status(version, wait=600)
                assert status.complete, f"version {version}: push not complete ({status})"
                time.sleep(0.5)  # the blob write after the last acknowledgement
                return cpu_seconds(registry_pid) - cpu0, pushed_bytes(metrics) - sent0

            publish()  # warm-up: the registry's first touch of its buffers
            ingest = [publish()[0] for _ in range(args.rounds)]
            print(f"publish with nobody watching: registry {statistics.median(ingest):.2f} CPU-s per version",
                  flush=True)
            for i in range(args.workers):
                procs.append(subprocess.Popen([sys.executable, "-m", "bench.bench_relay", "worker", address, f"w{i}"],
                                              env={**env, "OVERWORLD_TLS_DIR": str(identities["rollout-worker"])},
                                              cwd=ROOT))
            worker_pids = [p.pid for p in procs[1:]]
            deadline = time.monotonic() + 300
            while client.push_status(timeout=10).connected_watchers < args.workers:
                assert time.monotonic() < deadline, "the workers did not connect"
                assert all(p.poll() is None for p in procs), "a process died"
                time.sleep(0.2)
            rounds = []
            for k in range(args.rounds + 1):
                before = [cpu_seconds(pid) for pid in worker_pids]
                registry_cpu, sent = publish()
                workers = [cpu_seconds(pid) - b for pid, b in zip(worker_pids, before, strict=True)]
                row = {"version": version, "registry_cpu_seconds": round(registry_cpu, 3), "registry_sent_bytes": sent,
                       "worker_cpu_seconds": [round(w, 3) for w in workers]}
                print(f"  {'warm-up' if k == 0 else f'round {k}'}: registry {registry_cpu:.2f} CPU-s (sent "
                      f"{sent / size:.2f} copies), workers {', '.join(f'{w:.2f}' for w in workers)} CPU-s", flush=True)
                if k:
                    rounds.append(row)
            for proc in procs[1:]:  # the workers' part is measured: the registry alone from here
                proc.kill()
                proc.wait()
            time.sleep(1.0)
            cpu0, sent = cpu_seconds(registry_pid), 0
            for _ in range(args.fetches):
                sent += fetch_as_a_relay_does(address, version, size, identities["rollout-worker"])
            sending = (cpu_seconds(registry_pid) - cpu0) / (sent / 1e9)
            print(f"registry sending: {sending:.2f} CPU-s per GB ({sent / size:.0f} copies)", flush=True)
        finally:
            client.close()
            tls.reset()
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait()
    gb = size / 1e9
    ingest_cpu = statistics.median(ingest)
    per_worker = [w / gb for r in rounds for w in r["worker_cpu_seconds"]]
    return {
        "size_bytes": size, "workers": args.workers, "fanout": args.fanout, "rounds": rounds,
        "registry_publish_cpu_seconds": [round(c, 3) for c in ingest],
        "worker_cpu_seconds_per_gb": {"median": round(statistics.median(per_worker), 3),
                                      "min": round(min(per_worker), 3), "max": round(max(per_worker), 3)},
        "registry_sending_cpu_seconds_per_gb_sent": round(sending, 3),
        "registry_cpu_seconds_per_gb_of_version": round(
            statistics.median(r["registry_cpu_seconds"] for r in rounds) / gb, 3),
        "registry_publish_cpu_seconds_per_gb": round(ingest_cpu / gb, 3),
        "registry_copies_sent": round(statistics.median(r["registry_sent_bytes"] for r in rounds) / size, 2),
    }


def main() -> int:
    from bench.runs import write

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size-mb", type=float, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fanout", type=int, default=2)
    p.add_argument("--fetches", type=int, default=4, help="whole-version fetches the registry's sending is measured over")
    p.add_argument("--services", default=str(ROOT / "services"),
                   help="the services/ directory whose code runs (default: this checkout's)")
    p.add_argument("--name", default="relay", help="results file: bench/results/NAME.json")
    args = p.parse_args()
    load = os.getloadavg()
    result = measure(args, Path(args.services).resolve())
    result["load_average_before"] = [round(v, 2) for v in load]
    result["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    result["services"] = str(Path(args.services).resolve())
    result["targets"] = {"worker_cpu_seconds_per_gb": 2.0, "registry_sending_cpu_seconds_per_gb_sent": 2.0}
    w, r = result["worker_cpu_seconds_per_gb"]["median"], result["registry_sending_cpu_seconds_per_gb_sent"]
    result["within_target"] = w <= 2.0 and r <= 2.0
    print(f"\nper GB: worker {w:.2f} CPU-s (median of every worker and round), registry sending {r:.2f} CPU-s "
          f"per GB sent, registry in all {result['registry_cpu_seconds_per_gb_of_version']:.2f} CPU-s per GB "
          f"published (publish alone {result['registry_publish_cpu_seconds_per_gb']:.2f}); load average "
          f"{result['load_average_before'][0]} before, {result['load_average_after'][0]} after")
    write(args.name, result)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":  # its PYTHONPATH names the services tree measured
        worker_main(sys.argv[2], sys.argv[3])
    else:
        sys.path.insert(0, str(ROOT / "services"))
        raise SystemExit(main())
