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
import statistics
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuMeter:
    """CPU milliseconds per fragment spent by each role (fronts, clients, S3 server, Redis) in a phase."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.roles = roles

    def snapshot(self) -> dict[str, float]:
        return {role: sum(cpu_seconds(p) for p in pids) for role, pids in self.roles.items()}

    def per_fragment(self, before: dict[str, float], count: int) -> dict[str, float]:
        after = self.snapshot()
        return {role: (after[role] - before[role]) * 1000 / count for role in after}


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


def run_ingest(addresses: list[str], requests: list[bytes]) -> float:
    """Serialized InsertRequests through STREAMS_PER_FRONT streams per front; seconds until the last ack.
    The client sends bytes it serialized beforehand, as the raw baseline puts bytes it already has."""
    from overworld.core.grpc_util import channel
    from overworld.v1 import replay_buffer_pb2

    streams = [(a, s) for a in addresses for s in range(STREAMS_PER_FRONT)]
    parts = [requests[i::len(streams)] for i in range(len(streams))]
    errors: list[BaseException] = []

    def stream(address: str, part: list[bytes]) -> None:
        try:
            with channel(address) as ch:
                insert = ch.stream_stream("/overworld.v1.ReplayBuffer/Insert", request_serializer=None,
                                          response_deserializer=replay_buffer_pb2.InsertResponse.FromString)
                acks = list(insert(iter(part), timeout=300))
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


def run_sample(addresses: list[str], total: int, fragment_bytes: int) -> tuple[float, int]:
    """READERS_PER_FRONT readers per front draw every chunk once (max_reuse 1); seconds and bytes.
    The readers receive the chunks as bytes, as the raw baseline gets bytes."""
    from overworld.core.grpc_util import channel
    from overworld.v1 import replay_buffer_pb2

    lock = threading.Lock()
    got = [0, 0]
    finished = [0.0]
    errors: list[BaseException] = []

    def read(address: str) -> None:
        try:
            with channel(address) as ch:
                sample = ch.unary_stream("/overworld.v1.ReplayBuffer/Sample",
                                         request_serializer=replay_buffer_pb2.SampleRequest.SerializeToString,
                                         response_deserializer=None)
                while True:
                    with lock:
                        if got[0] >= total:
                            return
                    request = replay_buffer_pb2.SampleRequest(num_chunks=CHUNKS_PER_SAMPLE, timeout_seconds=0.2,
                                                              allow_partial=True)
                    for chunk in sample(request, timeout=60):  # one fragment per chunk here
                        with lock:
                            got[0] += 1
                            got[1] += len(chunk)
                            assert len(chunk) > fragment_bytes
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


class Raw:
    """The same bytes straight to S3 (one object per fragment) plus one small Redis write (put) or read
    (get) each: what the service path does per fragment, without the service."""

    def __init__(self, redis_url: str, s3: dict[str, str], blob: bytes) -> None:
        import redis

        from overworld.core.s3_blobs import S3BlobStore

        self.redis = redis.Redis.from_url(redis_url)
        self.store = S3BlobStore.from_url(f"s3://{BUCKET}/raw-{uuid.uuid4().hex[:8]}", s3["OVERWORLD_S3_ENDPOINT"],
                                          s3["OVERWORLD_S3_ACCESS_KEY"], s3["OVERWORLD_S3_SECRET_KEY"])
        self.blob = blob

    def _put(self, key: str) -> None:
        self.store.put(key, self.blob)
        self.redis.hset("raw:index", key, len(self.blob))

    def _get(self, key: str) -> int:
        self.redis.hget("raw:index", key)
        return len(self.store.get(key))

    def put(self, count: int, threads: int) -> tuple[float, list[str]]:
        keys = [f"raw/{uuid.uuid4().hex}" for _ in range(count)]
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            list(pool.map(self._put, keys))
            return count / (time.perf_counter() - started), keys

    def get(self, keys: list[str], threads: int) -> float:
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            list(pool.map(self._get, keys))
            rate = len(keys) / (time.perf_counter() - started)
        self.store.delete(keys)
        self.redis.hdel("raw:index", *keys)
        return rate


def measure(name: str, index_url: str, blobs_url: str, fronts: int, count: int, rounds: int, env: dict[str, str],
            servers: dict[str, list[int]], raw: Raw | None = None) -> dict:
    """`rounds` rounds of ingest then sample (fresh fragments each round). With `raw`, each ingest is
    followed by the raw puts and each sample by the raw gets, so that each comparison is made under the
    same machine load; the raw rate of a round is the better of two concurrencies: one thread per
    client stream (or reader), and the most requests the service itself keeps in flight (4 per stream:
    ingest_window; 4 per reader: prefetch)."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    template = template_fragment(run_id)

    def request(worker: str, seq: int) -> bytes:
        from overworld.v1 import replay_buffer_pb2

        f = type(template)()
        f.CopyFrom(template)
        f.header.worker_id, f.header.env_slot, f.header.sequence = worker, 0, seq
        return replay_buffer_pb2.InsertRequest(fragment=f).SerializeToString()

    nbytes = template.ByteSize()
    procs, addresses = start_fronts(index_url, blobs_url.replace("RUN", run_id), run_id, fronts,
                                    shared_process=index_url == "memory", env=env)
    streams, readers = fronts * STREAMS_PER_FRONT, fronts * READERS_PER_FRONT
    meter = CpuMeter({"fronts": [p.pid for p in procs], "clients": [os.getpid()], **servers})
    rounds_out = []
    try:
        warm = [request(f"warm{i}", 0) for i in range(streams)]
        run_ingest(addresses, warm)  # connections, code paths and caches warm
        run_sample(addresses, len(warm), nbytes)
        for r in range(rounds):
            # One env slot per worker, each worker on one stream: sequence numbers arrive in order.
            requests = [request(f"r{r}w{i % 8}", i // 8) for i in range(count)]
            one: dict[str, Any] = {"cpu_ms_per_fragment": {}}
            cpu = one["cpu_ms_per_fragment"]
            before = meter.snapshot()
            one["ingest"] = count / run_ingest(addresses, requests)
            cpu["ingest"] = meter.per_fragment(before, count)
            del requests
            if raw is not None:
                before = meter.snapshot()
                rate_a, keys_a = raw.put(count, streams)
                rate_b, keys_b = raw.put(count, streams * 4)
                one["raw_put"] = max(rate_a, rate_b)
                cpu["raw_put"] = meter.per_fragment(before, 2 * count)
            before = meter.snapshot()
            seconds, _ = run_sample(addresses, count, nbytes)
            one["sample"] = count / seconds
            cpu["sample"] = meter.per_fragment(before, count)
            if raw is not None:
                before = meter.snapshot()
                one["raw_get"] = max(raw.get(keys_a, readers), raw.get(keys_b, readers * 4))
                cpu["raw_get"] = meter.per_fragment(before, 2 * count)
                one["ingest_vs_raw"] = one["ingest"] / one["raw_put"]
                one["sample_vs_raw"] = one["sample"] / one["raw_get"]
            rounds_out.append(one)
    finally:
        for p in procs:
            stop(p)
    mb = nbytes / 1e6

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds_out)

    phases = ["ingest", "sample", *(["raw_put", "raw_get"] if raw is not None else [])]
    cpu_median = {ph: {role: statistics.median(r["cpu_ms_per_fragment"][ph][role] for r in rounds_out)
                       for role in meter.roles} for ph in phases}
    row = {"backend": name, "fronts": fronts, "fragments": count, "rounds": rounds_out, "fragment_bytes": nbytes,
           "cpu_ms_per_fragment": cpu_median,
           "ingest_fragments_per_s": median("ingest"), "ingest_mb_per_s": median("ingest") * mb,
           "sample_fragments_per_s": median("sample"), "sample_mb_per_s": median("sample") * mb}
    if raw is not None:
        row.update({"raw_put_fragments_per_s": median("raw_put"), "raw_get_fragments_per_s": median("raw_get"),
                    "ingest_vs_raw": median("ingest_vs_raw"), "sample_vs_raw": median("sample_vs_raw"),
                    # Total CPU per fragment, raw / service: the same ratio, much less sensitive to other load.
                    "ingest_cpu_vs_raw": sum(cpu_median["raw_put"].values()) / sum(cpu_median["ingest"].values()),
                    "sample_cpu_vs_raw": sum(cpu_median["raw_get"].values()) / sum(cpu_median["sample"].values())})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    f = sub.add_parser("front", help=argparse.SUPPRESS)
    f.add_argument("--index", required=True)
    f.add_argument("--blobs", required=True)
    f.add_argument("--run-id", required=True)
    f.add_argument("--ports", type=int, nargs="+", required=True)
    parser.add_argument("--fragments", type=int, default=24, help="fragments per round (~3 MB each)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per configuration (medians are reported)")
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
    try:
        wait_port(redis_port)
        wait_port(s3_port)
        blob = template_fragment("raw").SerializeToString()
        raw = Raw(redis_url, s3, blob)
        servers = {"s3": [s3_proc.pid], "redis": [redis_proc.pid]}
        for fronts in (1, 2):
            rows.append(measure("memory+local", "memory", str(work / "blobs" / "RUN"), fronts, count, rounds, env,
                                servers))
            print_row(rows[-1])
            rows.append(measure("redis+s3", redis_url, f"s3://{BUCKET}/RUN", fronts, count, rounds, env, servers, raw))
            print_row(rows[-1])
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
    print("\nCPU ms per fragment (medians), by process role; raw rows: the same bytes without the service")
    roles = ["fronts", "clients", "s3", "redis"]
    print(f"{'backend':<14}{'fronts':>7}{'phase':>9}" + "".join(f"{x:>9}" for x in roles) + f"{'total':>9}{'raw/svc':>9}")
    for r in rows:
        for phase, cpu in r["cpu_ms_per_fragment"].items():
            versus = {"ingest": "ingest_cpu_vs_raw", "sample": "sample_cpu_vs_raw"}.get(phase, "")
            ratio = f"{r[versus]:>9.0%}" if versus in r else ""
            print(f"{r['backend']:<14}{r['fronts']:>7}{phase:>9}" + "".join(f"{cpu[x]:>9.1f}" for x in roles)
                  + f"{sum(cpu.values()):>9.1f}{ratio}")
    ratios = [min(r["ingest_vs_raw"], r["sample_vs_raw"]) for r in rows if "ingest_vs_raw" in r]
    cpu_ratios = [min(r["ingest_cpu_vs_raw"], r["sample_cpu_vs_raw"]) for r in rows if "ingest_vs_raw" in r]
    target_met = min(ratios) >= 0.7
    print(f"\nfragment: {mb:.2f} MB ({LENGTH} steps of 64x64x3 uint8); MB/s = frag/s x {mb:.2f}. "
          f"Redis+S3 path vs raw, worst of ingest/sample and 1/2 fronts: {min(ratios):.0%} by throughput, "
          f"{min(cpu_ratios):.0%} by CPU per fragment (target >= 70%: {'met' if target_met else 'NOT met'}); "
          f"{elapsed:.0f}s on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "replay_buffer", "fragment_bytes": len(blob), "fragment_length": LENGTH,
        "fragments_per_round": count, "rounds": rounds, "streams_per_front": STREAMS_PER_FRONT,
        "readers_per_front": READERS_PER_FRONT, "chunks_per_sample": CHUNKS_PER_SAMPLE, "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0], "s3_server": "moto_server (loopback)",
        # Scalars per configuration, for bench/report.py (which skips lists); full detail in "results".
        "summary": {f"{r['backend']} {r['fronts']} front{'s' if r['fronts'] > 1 else ''}": {
            k: round(v, 3) for k, v in r.items() if isinstance(v, float)} for r in rows},
        "results": rows,
        "worst_ratio_vs_raw": min(ratios), "worst_cpu_ratio_vs_raw": min(cpu_ratios), "target_ratio": 0.7, "target_met": target_met,
        "seconds": round(elapsed, 1)}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def print_row(r: dict) -> None:
    print(f"  {r['backend']:<13} fronts={r['fronts']} ingest {r['ingest_fragments_per_s']:.1f} frag/s "
          f"({r['ingest_mb_per_s']:.0f} MB/s), sample {r['sample_fragments_per_s']:.1f} frag/s "
          f"({r['sample_mb_per_s']:.0f} MB/s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
