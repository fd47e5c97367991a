"""Replay-buffer throughput: ingest and sample, 1 and 2 fronts, embedded (memory + local) and
Redis + S3 backends, with 256-step Crafter-sized fragments (obs 256x64x64x3 uint8, ~3 MB), next to the
raw Redis + S3 put/get rate of the same bytes measured in the same run.

    python bench/bench_replay_buffer.py [--fragments 48] [--quick]

Starts its own redis-server and S3-protocol server (moto) on free loopback ports, runs every front as
its own process (`front` sub-command below; the embedded backend's two fronts share one process,
since its index lives in one process), and writes bench/results/replay_buffer.json.

The raw baseline uses the same servers, bytes and concurrency as the service path (one thread per
client stream for puts, one per reader for gets) and, per fragment, one S3 request plus one small
Redis write (put) or read (get). The ratio is service / raw.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services"))

import numpy as np  # noqa: E402

from overworld.core.fragment import Fragment, expected_tensors  # noqa: E402
from overworld.core.specs import Spaces, TensorSpec  # noqa: E402

SPACES = Spaces(obs={"rgb": TensorSpec((64, 64, 3), "uint8")}, action={"action": TensorSpec((), "int64")})
LENGTH = 256
BUCKET = "overworld-bench"
RESULTS = ROOT / "bench" / "results" / "replay_buffer.json"
STREAMS_PER_FRONT = 2  # rollout workers streaming into each front
READERS_PER_FRONT = 2  # trainer readers sampling from each front
CHUNKS_PER_SAMPLE = 4


# ------------------------------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        env.pop(var, None)
    env["no_proxy"] = "127.0.0.1,localhost"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), env.get("PYTHONPATH", "")])
    return env


def rb_config() -> Any:
    from overworld.core.config import ReplayBufferConfig

    return ReplayBufferConfig(max_chunks=100_000, max_reuse=1, max_staleness=1000, fragments_per_chunk=1,
                              max_fragment_bytes=64 * 1024 * 1024)


def template_fragment(run_id: str) -> Any:
    rng = np.random.default_rng(0)
    data = {}
    for name, (shape, dtype) in expected_tensors(SPACES, LENGTH).items():
        data[name] = (rng.integers(0, 255, size=shape, dtype=np.uint8) if np.dtype(dtype) == np.uint8
                      else np.zeros(shape, dtype=dtype))
    return Fragment(run_id, "bench", 0, 0, data).to_proto()


# ------------------------------------------------------------------------------------------ the front process


def serve_fronts(args: argparse.Namespace) -> int:
    """`front` sub-command: one process serving one or more fronts over one index + blob store."""
    import logging

    from overworld.core.blobs import open_blob_store
    from overworld.core.grpc_util import serve
    from overworld.replay_buffer.index import MemoryIndex
    from overworld.replay_buffer.server import ReplayBufferService, add_to_server

    logging.basicConfig(level=logging.WARNING)
    rb = rb_config()
    if args.index == "memory":
        index: Any = MemoryIndex(rb.max_chunks, rb.max_reuse, rb.max_staleness, rb.fragments_per_chunk)
    else:
        from overworld.replay_buffer.redis_index import RedisIndex

        index = RedisIndex.from_url(args.index, args.run_id, rb)
    blobs = open_blob_store(args.blobs)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    handles = []
    for port in args.ports:
        service = ReplayBufferService(index, blobs, args.run_id, LENGTH, rb.fragments_per_chunk, rb.max_chunks,
                                      lambda: SPACES, rb.max_fragment_bytes, sweep_interval=0)
        server = serve([(add_to_server, service, "overworld.v1.ReplayBuffer")], "127.0.0.1", port)
        handles.append((service, server))
    done.wait()
    for service, server in handles:
        service.stop()
        server.stop(1.0)
    return 0


def start_fronts(index_url: str, blobs_url: str, run_id: str, fronts: int, shared_process: bool,
                 env: dict[str, str]) -> tuple[list[subprocess.Popen], list[str]]:
    from overworld.core.grpc_util import wait_healthy

    ports = [free_port() for _ in range(fronts)]
    groups = [ports] if shared_process else [[p] for p in ports]
    procs = []
    for group in groups:
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "front", "--index", index_url, "--blobs", blobs_url, "--run-id", run_id,
             "--ports", *map(str, group)], env=env))
    addresses = [f"127.0.0.1:{p}" for p in ports]
    for address in addresses:
        wait_healthy(address, timeout=60)
    return procs, addresses


# ------------------------------------------------------------------------------------------ measurements


def run_ingest(addresses: list[str], fragments: list[Any]) -> float:
    """All fragments through STREAMS_PER_FRONT streams per front; seconds until the last ack."""
    from overworld.core.grpc_util import channel
    from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc

    streams = [(a, s) for a in addresses for s in range(STREAMS_PER_FRONT)]
    parts = [fragments[i::len(streams)] for i in range(len(streams))]
    errors: list[BaseException] = []

    def stream(address: str, part: list[Any]) -> None:
        try:
            with channel(address) as ch:
                stub = replay_buffer_pb2_grpc.ReplayBufferStub(ch)
                acks = list(stub.Insert((replay_buffer_pb2.InsertRequest(fragment=f) for f in part), timeout=300))
                assert len(acks) == len(part) and all(a.stored for a in acks)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=stream, args=(a, part)) for (a, _), part in zip(streams, parts, strict=True)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed


def run_sample(addresses: list[str], total: int) -> tuple[float, int]:
    """READERS_PER_FRONT readers per front draw every chunk once (max_reuse 1); seconds and bytes."""
    from overworld.core.grpc_util import channel
    from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc

    lock = threading.Lock()
    got = [0, 0]
    finished = [0.0]
    errors: list[BaseException] = []

    def read(address: str) -> None:
        try:
            with channel(address) as ch:
                stub = replay_buffer_pb2_grpc.ReplayBufferStub(ch)
                while True:
                    with lock:
                        if got[0] >= total:
                            return
                    request = replay_buffer_pb2.SampleRequest(num_chunks=CHUNKS_PER_SAMPLE, timeout_seconds=0.2,
                                                              allow_partial=True)
                    for chunk in stub.Sample(request, timeout=60):
                        with lock:
                            got[0] += len(chunk.fragments)
                            got[1] += sum(f.ByteSize() for f in chunk.fragments)
                            if got[0] >= total and not finished[0]:
                                finished[0] = time.perf_counter()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=read, args=(a,)) for a in addresses for _ in range(READERS_PER_FRONT)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return finished[0] - started, got[1]


def raw_rates(redis_url: str, s3: dict[str, str], blob: bytes, count: int, put_threads: int,
              get_threads: int) -> dict[str, float]:
    """The same bytes straight to S3 (one object per fragment) plus one small Redis write/read each."""
    import redis

    from overworld.core.s3_blobs import S3BlobStore

    r = redis.Redis.from_url(redis_url)
    store = S3BlobStore.from_url(f"s3://{BUCKET}/raw-{uuid.uuid4().hex[:8]}", s3["OVERWORLD_S3_ENDPOINT"],
                                 s3["OVERWORLD_S3_ACCESS_KEY"], s3["OVERWORLD_S3_SECRET_KEY"])
    keys = [f"raw/{i:06d}" for i in range(count)]

    def put(key: str) -> None:
        store.put(key, blob)
        r.hset("raw:index", key, len(blob))

    def get(key: str) -> int:
        r.hget("raw:index", key)
        return len(store.get(key))

    with ThreadPoolExecutor(put_threads) as pool:
        started = time.perf_counter()
        list(pool.map(put, keys))
        put_s = time.perf_counter() - started
    with ThreadPoolExecutor(get_threads) as pool:
        started = time.perf_counter()
        list(pool.map(get, keys))
        get_s = time.perf_counter() - started
    store.delete(keys)
    r.delete("raw:index")
    return {"put_threads": put_threads, "get_threads": get_threads, "put_fragments_per_s": count / put_s,
            "get_fragments_per_s": count / get_s}


def measure(name: str, index_url: str, blobs_url: str, fronts: int, count: int, rounds: int, env: dict[str, str],
            raw: Any = None) -> tuple[dict, list[dict]]:
    """Best of `rounds` ingest and sample runs (fresh fragments each round); with `raw`, a raw measurement
    after each round, interleaved so that both see the same machine load."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    template = template_fragment(run_id)

    def copy(worker: str, seq: int) -> Any:
        f = type(template)()
        f.CopyFrom(template)
        f.header.worker_id, f.header.env_slot, f.header.sequence = worker, 0, seq
        return f

    nbytes = template.ByteSize()
    procs, addresses = start_fronts(index_url, blobs_url.replace("RUN", run_id), run_id, fronts,
                                    shared_process=index_url == "memory", env=env)
    ingest, sample, raws = [], [], []
    try:
        warm = [copy(f"warm{i}", 0) for i in range(fronts * STREAMS_PER_FRONT)]
        run_ingest(addresses, warm)  # connections, code paths and caches warm
        run_sample(addresses, len(warm))
        for r in range(rounds):
            # One env slot per worker, each worker on one stream: sequence numbers arrive in order.
            fragments = [copy(f"r{r}w{i % 8}", i // 8) for i in range(count)]
            ingest.append(count / run_ingest(addresses, fragments))
            del fragments
            seconds, _ = run_sample(addresses, count)
            sample.append(count / seconds)
            if raw is not None:
                raws += raw()
    finally:
        for p in procs:
            stop(p)
    mb = nbytes / 1e6
    row = {"backend": name, "fronts": fronts, "fragments": count, "rounds": rounds, "fragment_bytes": nbytes,
           "ingest_fragments_per_s": max(ingest), "ingest_mb_per_s": max(ingest) * mb,
           "sample_fragments_per_s": max(sample), "sample_mb_per_s": max(sample) * mb,
           "ingest_rounds": ingest, "sample_rounds": sample}
    return row, raws


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    f = sub.add_parser("front", help=argparse.SUPPRESS)
    f.add_argument("--index", required=True)
    f.add_argument("--blobs", required=True)
    f.add_argument("--run-id", required=True)
    f.add_argument("--ports", type=int, nargs="+", required=True)
    parser.add_argument("--fragments", type=int, default=32, help="fragments per round (~3 MB each)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per configuration; the best one counts")
    parser.add_argument("--quick", action="store_true", help="12 fragments, 1 round")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.command == "front":
        return serve_fronts(args)
    count, rounds = (12, 1) if args.quick else (args.fragments, args.rounds)

    for binary in ("redis-server", "moto_server"):
        if shutil.which(binary) is None and not (Path(sys.executable).parent / binary).exists():
            print(f"{binary} is needed (redis-server: Debian package; moto_server: pip install 'moto[server]')")
            return 2
    env = clean_env()
    work = Path(tempfile.mkdtemp(prefix="rb-bench-"))
    redis_port, s3_port = free_port(), free_port()
    redis_proc = subprocess.Popen(
        ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(work), "--save", "",
         "--appendonly", "yes", "--appendfsync", "everysec"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    moto = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    s3_proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(s3_port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    s3 = {"OVERWORLD_S3_ENDPOINT": f"http://127.0.0.1:{s3_port}", "OVERWORLD_S3_ACCESS_KEY": "bench",
          "OVERWORLD_S3_SECRET_KEY": "bench"}
    env.update(s3)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    started = time.monotonic()
    rows: list[dict] = []
    raw_all: list[dict] = []
    try:
        wait_port(redis_port)
        wait_port(s3_port)
        blob = template_fragment("raw").SerializeToString()
        for fronts in (1, 2):
            row, _ = measure("memory+local", "memory", str(work / "blobs" / "RUN"), fronts, count, rounds, env)
            rows.append(row)
            print_row(row)
            streams, readers = fronts * STREAMS_PER_FRONT, fronts * READERS_PER_FRONT

            def raw(streams: int = streams, readers: int = readers) -> list[dict]:
                # The service has at most ingest_window (4) puts in flight per stream and prefetch (4) gets
                # per reader: the raw rate is the better of the stream/reader count and that bound.
                return [raw_rates(redis_url, s3, blob, count, streams, readers),
                        raw_rates(redis_url, s3, blob, count, streams * 4, readers * 4)]

            row, raws = measure("redis+s3", redis_url, f"s3://{BUCKET}/RUN", fronts, count, rounds, env, raw)
            for r in raws:
                r["fronts"] = fronts
            raw_all += raws
            row["raw_put_fragments_per_s"] = max(r["put_fragments_per_s"] for r in raws)
            row["raw_get_fragments_per_s"] = max(r["get_fragments_per_s"] for r in raws)
            row["ingest_vs_raw"] = row["ingest_fragments_per_s"] / row["raw_put_fragments_per_s"]
            row["sample_vs_raw"] = row["sample_fragments_per_s"] / row["raw_get_fragments_per_s"]
            rows.append(row)
            print_row(row)
    finally:
        stop(redis_proc)
        stop(s3_proc)
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - started
    mb = len(blob) / 1e6
    print()
    print(f"{'backend':<14}{'fronts':>7}{'ingest frag/s':>15}{'ingest MB/s':>13}{'sample frag/s':>15}"
          f"{'sample MB/s':>13}{'raw put/s':>11}{'raw get/s':>11}{'ingest/raw':>12}{'sample/raw':>12}")
    for r in rows:
        extra = (f"{r['raw_put_fragments_per_s']:>11.1f}{r['raw_get_fragments_per_s']:>11.1f}"
                 f"{r['ingest_vs_raw']:>12.0%}{r['sample_vs_raw']:>12.0%}" if "ingest_vs_raw" in r else "")
        print(f"{r['backend']:<14}{r['fronts']:>7}{r['ingest_fragments_per_s']:>15.1f}{r['ingest_mb_per_s']:>13.1f}"
              f"{r['sample_fragments_per_s']:>15.1f}{r['sample_mb_per_s']:>13.1f}{extra}")
    ratios = [min(r["ingest_vs_raw"], r["sample_vs_raw"]) for r in rows if "ingest_vs_raw" in r]
    target_met = min(ratios) >= 0.7
    print(f"\nfragment: {mb:.2f} MB ({LENGTH} steps of 64x64x3 uint8); raw MB/s = raw frag/s x {mb:.2f}; "
          f"Redis+S3 path vs raw: worst {min(ratios):.0%} (target >= 70%: {'met' if target_met else 'NOT met'}); "
          f"{elapsed:.0f}s on {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f})")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "replay_buffer", "fragment_bytes": len(blob), "fragment_length": LENGTH,
        "fragments_per_round": count, "rounds": rounds, "streams_per_front": STREAMS_PER_FRONT,
        "readers_per_front": READERS_PER_FRONT, "chunks_per_sample": CHUNKS_PER_SAMPLE, "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0], "s3_server": "moto_server (loopback)", "results": rows,
        "raw": raw_all, "worst_ratio_vs_raw": min(ratios), "target_ratio": 0.7, "target_met": target_met,
        "seconds": round(elapsed, 1)}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def print_row(r: dict) -> None:
    print(f"  {r['backend']:<13} fronts={r['fronts']} ingest {r['ingest_fragments_per_s']:.1f} frag/s "
          f"({r['ingest_mb_per_s']:.0f} MB/s), sample {r['sample_fragments_per_s']:.1f} frag/s "
          f"({r['sample_mb_per_s']:.0f} MB/s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
