"""Model-registry push benchmark: publish -> all workers swapped, next to a plain gRPC stream.

For each model size (25 MB and 250 MB by default), with 16 worker processes:

- registry: the driver publishes a version (ModelRegistryClient.publish, sha256 included) to a
  registry process (`python -m overworld.model_registry`); every worker process runs the real
  WeightsWatcher, and its loop (every 2 ms, like a worker between two inference batches) takes the
  new state dict, copies it into its model tensors and acknowledges the version. The time is from
  the start of publish() to the registry having all 16 acknowledgements (GetPushStatus waits for it).
- plain gRPC: one minimal gRPC server process streams the same number of bytes (pre-cut into chunks
  of the same size, no protobuf, identity serializers) to one stream in each of the same 16 worker
  processes, released at once; the time is from the release to the last receiver reporting that it
  has every byte.

Rounds alternate between the two so that both see the same machine load; the table reports
medians. Writes bench/results/registry.json.

    python bench/bench_registry.py [--workers 16] [--sizes-mb 25,250] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services"))
sys.path.insert(0, str(ROOT))  # bench.runs, when run as a script

import grpc  # noqa: E402

from bench.runs import provenance  # noqa: E402
from overworld.core.grpc_util import CHANNEL_OPTIONS  # noqa: E402

RAW_SERVICE = "bench.RawStream"
CHUNK = 4 << 20


def _identity(message: bytes) -> bytes:
    return message


# -- the plain gRPC stream ----------------------------------------------------------------------------
class RawServer:
    """Streams the same bytes to every waiting receiver once released; measures release -> last done."""

    def __init__(self, receivers: int) -> None:
        self.receivers = receivers
        self.cond = threading.Condition()
        self.round = 0
        self.waiting = 0
        self.done = 0
        self.last_done = 0.0
        self.chunks: list[bytes] = []
        self.mode = b"drop"

    def stream(self, request: bytes, context: grpc.ServicerContext) -> Any:
        with self.cond:
            mine = self.round
            self.waiting += 1
            self.cond.notify_all()
            while self.round == mine and context.is_active():
                self.cond.wait(1.0)
            self.waiting -= 1
            chunks, mode = self.chunks, self.mode
        yield mode  # b"keep": the receiver keeps the bytes (until the next round), b"drop": it drops them
        yield from chunks

    def report_done(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.cond:
            self.done += 1
            self.last_done = time.perf_counter()
            self.cond.notify_all()
        return b""

    def prepare(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        size = int(request)
        data = os.urandom(size)
        with self.cond:
            self.chunks = [data[i:i + CHUNK] for i in range(0, size, CHUNK)]
        return b""

    def waiting_count(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.cond:
            return str(self.waiting).encode()

    def start(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.cond:
            self.mode = request or b"drop"
            self.done = 0
            started = time.perf_counter()
            self.round += 1
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: self.done >= self.receivers, timeout=300)
            return json.dumps({"seconds": self.last_done - started if ok else None}).encode()


def raw_server_main(port_file: str, receivers: int) -> None:
    # accept the clients' keep-alive pings while the streams wait for the release
    options = [*CHANNEL_OPTIONS, ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
               ("grpc.http2.max_ping_strikes", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=receivers * 2 + 8), options=options)
    raw = RawServer(receivers)
    handlers = {
        "Stream": grpc.unary_stream_rpc_method_handler(raw.stream, _identity, _identity),
        "Done": grpc.unary_unary_rpc_method_handler(raw.report_done, _identity, _identity),
        "Prepare": grpc.unary_unary_rpc_method_handler(raw.prepare, _identity, _identity),
        "Waiting": grpc.unary_unary_rpc_method_handler(raw.waiting_count, _identity, _identity),
        "Start": grpc.unary_unary_rpc_method_handler(raw.start, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RAW_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


# -- one worker process: the real WeightsWatcher, and a plain receiver --------------------------------
def worker_main(registry: str, raw: str, worker_id: str, verify: bool, swap: str) -> None:
    import torch

    from overworld.model_registry.worker.watcher import WeightsWatcher

    torch.set_num_threads(1)
    watcher = WeightsWatcher(registry, worker_id, {}, verify=verify)
    model: dict[str, torch.Tensor] = {}

    def receive_plain() -> None:
        ch = grpc.insecure_channel(raw, options=CHANNEL_OPTIONS)
        stream = ch.unary_stream(f"/{RAW_SERVICE}/Stream", _identity, _identity)
        done = ch.unary_unary(f"/{RAW_SERVICE}/Done", _identity, _identity)
        kept: list[bytes] = []
        while True:
            messages = stream(b"")
            keep = next(messages) == b"keep"
            kept = []  # what the last round kept goes now, as a worker drops its old weights
            for chunk in messages:
                if keep:
                    kept.append(chunk)
            done(b"")

    threading.Thread(target=receive_plain, daemon=True).start()
    while True:  # the worker loop: between two "inference batches", swap in what arrived
        got = watcher.take()
        if got is not None:
            version, state = got
            if swap == "assign":  # load_state_dict(state, assign=True): the model takes the received tensors
                model = state
            else:  # load_state_dict(state): copied into the model's own tensors
                if set(model) != set(state) or any(model[k].shape != v.shape for k, v in state.items()):
                    model = {k: torch.empty_like(v) for k, v in state.items()}
                with torch.no_grad():
                    for k, v in state.items():
                        model[k].copy_(v)
            del state, got
            watcher.ack(version)
        time.sleep(0.002)


# -- the driver ---------------------------------------------------------------------------------------------
def _wait_file(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise TimeoutError(f"{path} not written")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pids: list[int]) -> float:
    """user + system CPU time of these processes (all their threads), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _model_bytes(size: int) -> bytes:
    import torch

    from overworld.core.wire.weights import to_bytes

    n_tensors = 10
    per = size // 4 // n_tensors
    gen = torch.Generator().manual_seed(size)
    state = {f"layer{i}.weight": torch.rand(per, generator=gen) for i in range(n_tensors)}
    return to_bytes(state)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--sizes-mb", default="25,250")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--verify", action="store_true",
                   help="workers check the sha256 of every version (OVERWORLD_WEIGHTS_VERIFY=1; off by default)")
    p.add_argument("--cut-through", action="store_true",
                   help="the registry streams a version to the workers while it is still being published")
    p.add_argument("--swap", choices=("copy", "assign"), default="copy",
                   help="how a worker swaps: copy into its model (load_state_dict) or adopt the tensors (assign=True)")
    p.add_argument("--out", default=str(ROOT / "bench/results/registry.json"))
    p.add_argument("--no-tls", action="store_true", help="skip the same measurement with mutual TLS")
    args = p.parse_args()
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mb.split(",")]
    need = (2 * args.workers + 4) * max(sizes)
    if _mem_available() < need:
        print(f"not enough memory: need about {need >> 20} MB, {_mem_available() >> 20} MB available", file=sys.stderr)
        return 1
    results = run(args, sizes, secure=False)
    if not args.no_tls:
        # The same fleet with mutual TLS (registry, workers and publisher each with its certificate),
        # right after in the same run: the registry's push time with and without.
        print("\nthe same with mutual TLS:", flush=True)
        secure = run(args, sizes, secure=True)
        results["tls"] = {}
        def cpu(row: dict[str, Any], role: str = "") -> float:  # CPU seconds per push (median): all, or one role
            return statistics.median(r["registry"]["cpu_seconds"][role] if role else
                                     sum(r["registry"]["cpu_seconds"].values()) for r in row["rounds"])

        for plain, tls_row in zip(results["sizes"], secure["sizes"], strict=True):
            cost = 1 - plain["registry_median_seconds"] / tls_row["registry_median_seconds"]
            results["tls"][f"{plain['model_bytes'] / 1e6:.0f}MB"] = {
                "plaintext_median_seconds": round(plain["registry_median_seconds"], 3),
                "tls_median_seconds": round(tls_row["registry_median_seconds"], 3),
                "tls_rounds_seconds": [r["registry"]["seconds"] for r in tls_row["rounds"]],
                "plaintext_cpu_seconds": round(cpu(plain), 2), "tls_cpu_seconds": round(cpu(tls_row), 2),
                "cpu_cost": round(1 - cpu(plain) / cpu(tls_row), 3),
                # On a cluster each worker decrypts on its own node: the registry's share is what one pod pays.
                "registry_cpu_seconds": {"plaintext": round(cpu(plain, "server"), 2),
                                         "tls": round(cpu(tls_row, "server"), 2)},
                "workers_cpu_seconds": {"plaintext": round(cpu(plain, "workers"), 2),
                                        "tls": round(cpu(tls_row, "workers"), 2)},
                "throughput_cost": round(cost, 3), "within_target": cost <= 0.10}
        results["tls_target_max_cost"] = 0.10
    return report(args, results)


def run(args: argparse.Namespace, sizes: list[int], secure: bool) -> dict[str, Any]:
    from overworld.core.security import tls
    from overworld.model_registry.client import ModelRegistryClient

    env = {**os.environ, "OVERWORLD_LOG_FORMAT": "text", "OVERWORLD_LOG_LEVEL": "WARNING",
           "PYTHONPATH": str(ROOT / "services"), "no_proxy": "127.0.0.1,localhost"}
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        env.pop(var, None)
    procs: list[subprocess.Popen] = []
    results: dict[str, Any] = {"workers": args.workers, "rounds": args.rounds, "chunk_bytes": CHUNK,
                               "worker_verifies_sha256": args.verify, "swap": args.swap,
                               "cut_through": args.cut_through, "sizes": []}
    with tempfile.TemporaryDirectory(prefix="bench-registry-") as tmp:
        identities = tls.write_run_credentials(Path(tmp, "tls"), "bench") if secure else {}

        def as_identity(name: str) -> dict[str, str]:
            return {**env, "OVERWORLD_TLS_DIR": str(identities[name])} if secure else env

        tls.use(identities.get("trainer"))  # this process publishes, as the trainer does
        try:
            port = _free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "overworld.model_registry", "--port", str(port),
                                           "--blobs", f"{tmp}/blobs", "--retain", "2",
                                           "--registry-cut-through", "1" if args.cut_through else "0",
                                           "--registry-relay-fanout", "0"],
                                          env=as_identity("model-registry")))
            registry = f"127.0.0.1:{port}"
            port_file = Path(tmp, "raw-port")
            procs.append(subprocess.Popen([sys.executable, __file__, "raw-server", str(port_file), str(args.workers)],
                                          env=env))
            raw = f"127.0.0.1:{_wait_file(port_file)}"
            for i in range(args.workers):
                procs.append(subprocess.Popen([sys.executable, __file__, "worker", registry, raw, f"bench-w{i}",
                                               "1" if args.verify else "0", args.swap], env=as_identity("rollout-worker")))
            client = ModelRegistryClient(registry)
            ch = grpc.insecure_channel(raw, options=CHANNEL_OPTIONS)
            raw_call = {name: ch.unary_unary(f"/{RAW_SERVICE}/{name}", _identity, _identity)
                        for name in ("Prepare", "Waiting", "Start")}
            started = time.monotonic()
            while True:
                try:
                    watchers = client.push_status(timeout=5).connected_watchers
                    waiting = int(raw_call["Waiting"](b"", timeout=5))
                except grpc.RpcError:
                    watchers = waiting = 0
                if watchers == args.workers and waiting == args.workers:
                    break
                if time.monotonic() - started > 120:
                    raise TimeoutError(f"workers not ready: {watchers} watching, {waiting} waiting")
                time.sleep(0.2)
            print(f"{args.workers} workers ready in {time.monotonic() - started:.1f}s", flush=True)
            version = 0

            registry_pid, raw_pid = procs[0].pid, procs[1].pid
            worker_pids = [p.pid for p in procs[2:]]

            def cpu() -> dict[str, float]:
                return {"sender": _cpu_seconds([os.getpid()]), "server": _cpu_seconds([registry_pid, raw_pid]),
                        "workers": _cpu_seconds(worker_pids)}

            def cpu_since(before: dict[str, float]) -> dict[str, float]:
                now = cpu()
                return {k: round(now[k] - before[k], 2) for k in now}

            def registry_round(data: bytes) -> dict[str, Any]:
                nonlocal version
                version += 1
                before = cpu()
                t0, t0_unix = time.perf_counter(), time.time()
                client.publish(version, data, parent=version - 1)
                t_published = time.perf_counter()
                deadline = time.monotonic() + 300
                status = client.push_status(version, wait=10)
                while not status.complete and time.monotonic() < deadline:
                    status = client.push_status(version, wait=10)
                if not status.complete or status.acked != args.workers:
                    raise RuntimeError(f"version {version}: {status.acked}/{status.watchers} acknowledged")
                # the last worker swaps in the version before Publish returns (the registry stores it
                # in the blob store meanwhile): the end is the registry's time of the last acknowledgement
                return {"seconds": status.last_ack_unix - t0_unix, "publish_seconds": t_published - t0,
                        "manifest_after_seconds": status.published_unix - t0_unix,
                        "registry_push_seconds": status.push_seconds, "cpu_seconds": cpu_since(before)}

            def raw_round(mode: bytes = b"drop") -> dict[str, Any]:
                deadline = time.monotonic() + 60
                while int(raw_call["Waiting"](b"")) < args.workers:
                    if time.monotonic() > deadline:
                        raise TimeoutError("plain receivers not waiting")
                    time.sleep(0.01)
                before = cpu()
                seconds = json.loads(raw_call["Start"](mode, timeout=300))["seconds"]
                return {"seconds": seconds, "cpu_seconds": cpu_since(before)}

            for size in sizes:
                base = _model_bytes(size)
                raw_call["Prepare"](str(len(base)).encode(), timeout=120)
                variants = []
                for k in range(args.rounds + 1):  # a distinct payload (and sha256) per version
                    b = bytearray(base)
                    b[-1] ^= (k + 1) & 0xFF
                    b[-2] ^= (size >> 20) & 0xFF
                    variants.append(bytes(b))
                    del b
                skipped = {"seconds": float("nan")}  # with TLS only the registry is measured
                warm = {"registry": registry_round(variants[0]),
                        "plain_grpc": skipped if secure else raw_round(),
                        "plain_grpc_keep": skipped if secure else raw_round(b"keep")}
                rounds: list[dict[str, Any]] = []
                for k in range(args.rounds):
                    plain = skipped if secure else raw_round()
                    keep = skipped if secure else raw_round(b"keep")
                    reg = registry_round(variants[k + 1])
                    rounds.append({"plain_grpc": plain, "plain_grpc_keep": keep, "registry": reg})
                    print(f"  {len(base) / 1e6:6.1f} MB round {k + 1}: plain {plain['seconds']:.3f}s, plain keeping "
                          f"the bytes {keep['seconds']:.3f}s, registry {reg['seconds']:.3f}s "
                          f"(publish returned after {reg['publish_seconds']:.3f}s)", flush=True)
                del variants
                plain_med = statistics.median(r["plain_grpc"]["seconds"] for r in rounds)
                keep_med = statistics.median(r["plain_grpc_keep"]["seconds"] for r in rounds)
                reg_med = statistics.median(r["registry"]["seconds"] for r in rounds)
                push_med = statistics.median(r["registry"]["registry_push_seconds"] for r in rounds)
                results["sizes"].append({
                    "model_bytes": len(base), "warmup": warm, "rounds": rounds,
                    "plain_grpc_median_seconds": plain_med, "plain_grpc_keep_median_seconds": keep_med,
                    "registry_median_seconds": reg_med, "registry_push_median_seconds": push_med,
                    "ratio": reg_med / plain_med, "ratio_to_keep": reg_med / keep_med,
                    "within_target": reg_med / plain_med <= 1.3})
                del base
        finally:
            tls.reset()
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait()
    return results


def report(args: argparse.Namespace, results: dict[str, Any]) -> int:
    # bench/report.py shows dicts, not lists: the medians by size
    results["summary"] = {f"{s['model_bytes'] / 1e6:.0f}MB": {
        k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()
        if k not in ("rounds", "warmup", "model_bytes")} for s in results["sizes"]}
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average": os.getloadavg()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**provenance(), **results}, indent=1))
    print()
    print(f"publish -> all {args.workers} workers swapped (median of {args.rounds} rounds), target <= 1.3x plain gRPC "
          f"(worker sha256 check {'on' if args.verify else 'off'}, swap by {args.swap})")
    print(f"{'model':>9} {'plain gRPC':>11} {'registry':>9} {'ratio':>6}   {'plain, kept':>11} {'ratio':>6}")
    for s in results["sizes"]:
        print(f"{s['model_bytes'] / 1e6:7.1f}MB {s['plain_grpc_median_seconds']:10.3f}s {s['registry_median_seconds']:8.3f}s "
              f"{s['ratio']:5.2f}x   {s['plain_grpc_keep_median_seconds']:10.3f}s {s['ratio_to_keep']:5.2f}x"
              f"  {'within target' if s['within_target'] else 'MISSED'}")
    print("plain gRPC: receivers drop each chunk; plain, kept: receivers keep the bytes until the next round, as a "
          "worker keeps its weights")
    for size, row in results.get("tls", {}).items():
        print(f"mutual TLS, {size}: registry {row['plaintext_median_seconds']:.3f}s plaintext, "
              f"{row['tls_median_seconds']:.3f}s with TLS: {row['throughput_cost']:.0%} of the throughput, "
              f"{row['cpu_cost']:.0%} of the CPU "
              f"(target <= 10%: {'met' if row['within_target'] else 'MISSED'})")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "raw-server":
        raw_server_main(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1", sys.argv[6])
    else:
        raise SystemExit(main())
