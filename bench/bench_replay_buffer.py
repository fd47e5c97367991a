"""Replay-buffer throughput: ingest and sample, 1 and 2 fronts, embedded (memory + local) and
Redis + S3 backends, with 256-step Crafter-sized fragments (obs 256x64x64x3 uint8, ~3 MB), next to the
raw Redis + S3 put/get rate of the same bytes measured in the same run.

Sample is measured three ways, each followed by its own raw get of fresh keys so that every ratio
compares rates taken back to back: in-band (the front reads each blob and streams it), by reference
(the front claims and sends blob keys, SampleRequest.blob_refs; the reader process gets the blobs from
the store in parallel, as bytes, like the in-band readers and the raw gets), and through the trainer's
reader (`ReplayBufferClient.sample`: by reference, and every blob parsed into a
SampledChunk message, which the raw gets do not do).

    python -m bench.bench_replay_buffer [--fragments 48] [--rounds 5] [--quick]

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
sys.path.insert(0, str(ROOT))  # bench.runs, when run as a script

import numpy as np  # noqa: E402

from bench.runs import provenance  # noqa: E402
from overworld.core.net import free_port, wait_port  # noqa: E402
from overworld.core.specs import Spaces, TensorSpec  # noqa: E402
from overworld.core.wire.fragment import Fragment, expected_tensors  # noqa: E402
from rehearsal.server_binaries import ServerBinaryUnavailable, locate  # noqa: E402

SPACES = Spaces(obs={"rgb": TensorSpec((64, 64, 3), "uint8")}, action={"action": TensorSpec((), "int64")})
LENGTH = 256
BUCKET = "overworld-bench"
RESULTS = ROOT / "bench" / "results" / "replay_buffer.json"
STREAMS_PER_FRONT = 2  # rollout workers streaming into each front
READERS_PER_FRONT = 2  # trainer readers sampling from each front
CHUNKS_PER_SAMPLE = 4
# The fronts' ref grace: 2 s, the delete delay, so that blobs are deleted (S3 work) 2 s after they leave
# whichever way they were sampled, as before sampling by reference existed; readers here fetch within
# milliseconds of the claim. (The default, 60 s, would move that work into the next phase.)
REF_GRACE = 2.0


# ------------------------------------------------------------------------------------------ helpers






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


def insert_request(template: Any, worker: str, seq: int) -> bytes:
    """A serialized InsertRequest of `template` as fragment `seq` of `worker`'s env slot 0."""
    from overworld.v1 import replay_buffer_pb2

    f = type(template)()
    f.CopyFrom(template)
    f.header.worker_id, f.header.env_slot, f.header.sequence = worker, 0, seq
    return replay_buffer_pb2.InsertRequest(fragment=f).SerializeToString()


# ------------------------------------------------------------------------------------------ the front process


def serve_fronts(args: argparse.Namespace) -> int:
    """`front` sub-command: one process serving one or more fronts over one index + blob store."""
    import logging

    from overworld.core.blobs.urls import open_blob_store
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
                                      lambda: SPACES, rb.max_fragment_bytes, sweep_interval=0, ref_grace=REF_GRACE)
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
        wait_healthy(address, timeout=60, peer="replay-buffer")
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
            with channel(address, "replay-buffer") as ch:
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
    """READERS_PER_FRONT readers per front draw `total` chunks (max_reuse 1: each once); seconds and bytes.
    The readers receive the chunks as bytes, as the raw baseline gets bytes."""
    from overworld.core.grpc_util import channel
    from overworld.v1 import replay_buffer_pb2

    lock = threading.Lock()
    got = [0, 0, 0]  # chunks received, bytes, chunks asked for
    finished = [0.0]
    errors: list[BaseException] = []

    def read(address: str) -> None:
        try:
            with channel(address, "replay-buffer") as ch:
                sample = ch.unary_stream("/overworld.v1.ReplayBuffer/Sample",
                                         request_serializer=replay_buffer_pb2.SampleRequest.SerializeToString,
                                         response_deserializer=None)
                while True:
                    with lock:  # exactly `total` chunks are drawn (the buffer may hold more)
                        n = min(CHUNKS_PER_SAMPLE, total - got[2])
                        got[2] += n
                    if n == 0:
                        return
                    while n > 0:
                        request = replay_buffer_pb2.SampleRequest(num_chunks=n, timeout_seconds=0.2,
                                                                  allow_partial=True)
                        for chunk in sample(request, timeout=60):  # one fragment per chunk here
                            n -= 1
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


def run_sample_refs(clients: list[Any], total: int, fragment_bytes: int, fetch: tuple[Any, Any] | None
                    ) -> tuple[float, int]:
    """Like run_sample, but by reference: one reader per client, each asking for CHUNKS_PER_SAMPLE chunks at a
    time. `fetch` (store, thread pool): the reader claims over gRPC (SampleRequest.blob_refs) and gets the
    blobs from the store in parallel, as bytes (what run_sample's readers and the raw gets receive). None:
    through the trainer's reader (`ReplayBufferClient.sample`), which also parses every blob into a SampledChunk."""
    from overworld.v1 import replay_buffer_pb2

    def claim_and_get(client: Any, n: int) -> int:
        assert fetch is not None
        store, pool = fetch
        got = 0
        while got < n and not stop.is_set():
            request = replay_buffer_pb2.SampleRequest(num_chunks=n - got, timeout_seconds=0.2, allow_partial=True,
                                                      blob_refs=True)
            refs = list(client.call("Sample", request, timeout=60))  # the claims, as the front sends them
            gets = [pool.submit(store.get, key) for ref in refs for key in ref.blob_keys]
            for get in gets:  # one fragment per chunk here
                assert len(get.result()) > fragment_bytes - 4096
            got += len(refs)
        return got

    def reader(i: int, client: Any, n: int, stop: threading.Event) -> int:
        chunks = client.sample(n, f"bench-r{i}", wait=0.2, stop=stop, blob_refs=True)
        for chunk in chunks:  # one fragment per chunk here
            # (reading .tensors would copy 3 MB, and upb's ByteSize() serializes the message)
            assert not chunk.blob_keys and len(chunk.fragments) == 1 and chunk.fragments[0].header.length
        return len(chunks)

    lock = threading.Lock()
    got = [0, 0, 0]  # chunks asked for, chunks received, bytes
    finished = [0.0]
    stop = threading.Event()
    errors: list[BaseException] = []

    def read(i: int, client: Any) -> None:
        try:
            while not stop.is_set():
                with lock:  # sample returns only with all it asked for: ask for exactly what is left
                    n = min(CHUNKS_PER_SAMPLE, total - got[0])
                    got[0] += n
                if n == 0:
                    return
                received = claim_and_get(client, n) if fetch is not None else reader(i, client, n, stop)
                with lock:
                    got[1] += received
                    got[2] += received * fragment_bytes
                    if got[1] >= total and not finished[0]:
                        finished[0] = time.perf_counter()
        except BaseException as err:
            errors.append(err)
            stop.set()

    threads = [threading.Thread(target=read, args=(i, client)) for i, client in enumerate(clients)]
    watchdog = threading.Timer(300, stop.set)  # the buffer should hold `total` chunks; never hang on a bug
    watchdog.start()
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    watchdog.cancel()
    if errors:
        raise errors[0]
    if got[1] < total:
        raise RuntimeError(f"sampled only {got[1]} of {total} chunks by reference in 300 s")
    return finished[0] - started, got[2]


class Raw:
    """The same bytes straight to S3 (one object per fragment) plus one small Redis write (put) or read
    (get) each: what the service path does per fragment, without the service."""

    def __init__(self, redis_url: str, s3: dict[str, str], blob: bytes) -> None:
        import redis

        from overworld.core.blobs.s3 import S3BlobStore

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
    """`rounds` rounds, each: ingest 3 x `count` fresh fragments, then sample `count` in-band (`sample`),
    `count` by reference into bytes (`sample_refs`) and `count` through the trainer's reader
    (`sample_reader`: by reference, parsed). With `raw`, the ingest is followed by raw puts and each
    sample by raw gets, so that each comparison is made under the same machine load; the raw rate of a
    round is the better of two concurrencies: one thread per client stream (or reader), and the most
    requests the service itself keeps in flight (4 per stream: ingest_window; 4 per reader: prefetch
    in-band, CHUNKS_PER_SAMPLE by reference)."""
    from overworld.core.blobs.urls import open_blob_store
    from overworld.replay_buffer.client import ReplayBufferClient

    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    template = template_fragment(run_id)

    def request(worker: str, seq: int) -> bytes:
        return insert_request(template, worker, seq)

    nbytes = template.ByteSize()
    procs, addresses = start_fronts(index_url, blobs_url.replace("RUN", run_id), run_id, fronts,
                                    shared_process=index_url == "memory", env=env)
    streams, readers = fronts * STREAMS_PER_FRONT, fronts * READERS_PER_FRONT
    meter = CpuMeter({"fronts": [p.pid for p in procs], "clients": [os.getpid()], **servers})
    rounds_out = []
    # The by-reference readers' clients (a channel each) live across rounds, as a trainer's does (GetStoreInfo
    # once per client).
    ref_clients = [ReplayBufferClient(a) for a in addresses for _ in range(READERS_PER_FRONT)]
    info = ref_clients[0].store_info(timeout=30)
    fetch = (open_blob_store(info.blob_store_url), ThreadPoolExecutor(readers * CHUNKS_PER_SAMPLE))
    # (phase, its raw get's key suffix, how it samples `count` chunks)
    parts = [("sample", "", lambda: run_sample(addresses, count, nbytes)),
             ("sample_refs", "_refs", lambda: run_sample_refs(ref_clients, count, nbytes, fetch)),
             ("sample_reader", "_reader", lambda: run_sample_refs(ref_clients, count, nbytes, None))]
    warm = [lambda: run_sample(addresses, streams, nbytes), lambda: run_sample_refs(ref_clients, streams, nbytes, fetch),
            lambda: run_sample_refs(ref_clients, streams, nbytes, None)]
    try:
        for k, sample_warm in enumerate(warm):  # connections, code paths and caches warm
            run_ingest(addresses, [request(f"warm{i}", k) for i in range(streams)])
            sample_warm()
        total = count * len(parts)  # ingested at once; each way of sampling then draws `count`
        for r in range(rounds):
            one: dict[str, Any] = {"cpu_ms_per_fragment": {}}
            cpu = one["cpu_ms_per_fragment"]
            # One env slot per worker, each worker on one stream: sequence numbers arrive in order.
            requests = [request(f"r{r}w{i % 8}", i // 8) for i in range(total)]
            before = meter.snapshot()
            one["ingest"] = total / run_ingest(addresses, requests)
            cpu["ingest"] = meter.per_fragment(before, total)
            del requests
            if raw is not None:
                before = meter.snapshot()
                rate_a, keys_a = raw.put(total, streams)
                rate_b, keys_b = raw.put(total, streams * 4)
                one["raw_put"] = max(rate_a, rate_b)
                cpu["raw_put"] = meter.per_fragment(before, 2 * total)
                one["ingest_vs_raw"] = one["ingest"] / one["raw_put"]
            for k, (phase, suffix, sample) in enumerate(parts):
                before = meter.snapshot()
                seconds, _ = sample()
                one[phase] = count / seconds
                cpu[phase] = meter.per_fragment(before, count)
                if raw is not None:
                    part = slice(k * count, (k + 1) * count)
                    before = meter.snapshot()
                    one["raw_get" + suffix] = max(raw.get(keys_a[part], readers), raw.get(keys_b[part], readers * 4))
                    cpu["raw_get" + suffix] = meter.per_fragment(before, 2 * count)
                    one[phase + "_vs_raw"] = one[phase] / one["raw_get" + suffix]
            rounds_out.append(one)
    finally:
        fetch[1].shutdown()
        for client in ref_clients:
            client.close()
        for p in procs:
            stop(p)
    mb = nbytes / 1e6

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds_out)

    samples = [(phase, suffix) for phase, suffix, _ in parts]
    phases = ["ingest", *(p for p, _ in samples),
              *(["raw_put", *("raw_get" + x for _, x in samples)] if raw is not None else [])]
    cpu_median = {ph: {role: statistics.median(r["cpu_ms_per_fragment"][ph][role] for r in rounds_out)
                       for role in meter.roles} for ph in phases}
    row = {"backend": name, "fronts": fronts, "fragments": count, "rounds": rounds_out, "fragment_bytes": nbytes,
           "cpu_ms_per_fragment": cpu_median,
           "ingest_fragments_per_s": median("ingest"), "ingest_mb_per_s": median("ingest") * mb}
    for phase, _ in samples:
        row.update({f"{phase}_fragments_per_s": median(phase), f"{phase}_mb_per_s": median(phase) * mb})
    if raw is not None:
        def cpu_ratio(raw_phase: str, phase: str) -> float:
            # Total CPU per fragment, raw / service: the same ratio, much less sensitive to other load.
            return sum(cpu_median[raw_phase].values()) / sum(cpu_median[phase].values())

        row.update({"raw_put_fragments_per_s": median("raw_put"), "ingest_vs_raw": median("ingest_vs_raw"),
                    "ingest_cpu_vs_raw": cpu_ratio("raw_put", "ingest")})
        for phase, suffix in samples:
            row.update({f"raw_get{suffix}_fragments_per_s": median("raw_get" + suffix),
                        f"{phase}_vs_raw": median(phase + "_vs_raw"),
                        f"{phase}_cpu_vs_raw": cpu_ratio("raw_get" + suffix, phase)})
    return row


def measure_tls(count: int, rounds: int, env: dict[str, str], work: Path) -> dict:
    """Ingest through one front with mutual TLS and one without (memory + local backend, so the
    difference is the transport), rounds alternating between the two: fragments/s and the cost, and
    the CPU per fragment of the front and the client (less sensitive to the machine's other load)."""
    from overworld.core.security import tls

    identities = tls.write_run_credentials(work / "tls", "bench")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    template = template_fragment(run_id)

    def request(worker: str, seq: int) -> bytes:
        return insert_request(template, worker, seq)

    fronts = {}
    procs: list[subprocess.Popen] = []
    try:
        for mode, front_env, client in (("plaintext", env, None),
                                        ("tls", {**env, "OVERWORLD_TLS_DIR": str(identities["replay-buffer"])},
                                         identities["rollout-worker"])):
            tls.use(client)
            started, addresses = start_fronts("memory", str(work / f"tls-blobs-{mode}"), run_id, 1, True, front_env)
            procs += started
            fronts[mode] = (addresses, client, CpuMeter({"front": [p.pid for p in started], "client": [os.getpid()]}))
        rates: dict[str, list[float]] = {"plaintext": [], "tls": []}
        cpu: dict[str, list[float]] = {"plaintext": [], "tls": []}
        total = 3 * count
        for r in range(rounds + 1):  # round 0 warms both up
            for mode, (addresses, client, meter) in fronts.items():
                tls.use(client)
                requests = [request(f"{mode}r{r}w{i % 8}", i // 8) for i in range(total)]
                before = meter.snapshot()
                rate = total / run_ingest(addresses, requests)
                if r:
                    rates[mode].append(rate)
                    cpu[mode].append(sum(meter.per_fragment(before, total).values()))
    finally:
        tls.reset()
        for p in procs:
            stop(p)
    plain, secure = statistics.median(rates["plaintext"]), statistics.median(rates["tls"])
    cost = 1 - secure / plain
    cpu_plain, cpu_tls = statistics.median(cpu["plaintext"]), statistics.median(cpu["tls"])
    return {"backend": "memory+local", "fronts": 1, "fragments_per_round": total, "rounds": rounds,
            "plaintext_ingest_fragments_per_s": plain, "tls_ingest_fragments_per_s": secure,
            "plaintext_rounds": rates["plaintext"], "tls_rounds": rates["tls"],
            "plaintext_cpu_ms_per_fragment": cpu_plain, "tls_cpu_ms_per_fragment": cpu_tls,
            "cpu_cost": 1 - cpu_plain / cpu_tls,
            "throughput_cost": cost, "target_max_cost": 0.10, "within_target": cost <= 0.10}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    f = sub.add_parser("front", help=argparse.SUPPRESS)
    f.add_argument("--index", required=True)
    f.add_argument("--blobs", required=True)
    f.add_argument("--run-id", required=True)
    f.add_argument("--ports", type=int, nargs="+", required=True)
    parser.add_argument("--fragments", type=int, default=48,
                        help="fragments per way of sampling per round (~3 MB each; 3x as many are ingested)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per configuration (medians are reported)")
    parser.add_argument("--quick", action="store_true", help="12 fragments, 1 round")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.command == "front":
        return serve_fronts(args)
    count, rounds = (12, 1) if args.quick else (args.fragments, args.rounds)

    if shutil.which("moto_server") is None and not (Path(sys.executable).parent / "moto_server").exists():
        print("moto_server is needed: pip install 'moto[server]' (the dev extra)")
        return 2
    try:
        redis_server = str(locate("redis-server"))  # the system's, or the project's pinned copy
    except ServerBinaryUnavailable as err:
        print(f"redis-server is needed: {err}")
        return 2
    env = clean_env()
    work = Path(tempfile.mkdtemp(prefix="rb-bench-"))
    redis_port, s3_port = free_port(), free_port()
    redis_proc = subprocess.Popen(
        [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(work), "--save", "",
         "--appendonly", "yes", "--appendfsync", "everysec"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    moto = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    s3_proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(s3_port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    s3 = {"OVERWORLD_S3_ENDPOINT": f"http://127.0.0.1:{s3_port}", "OVERWORLD_S3_ACCESS_KEY": "bench",
          "OVERWORLD_S3_SECRET_KEY": "bench"}
    env.update(s3)
    os.environ.update(s3)  # this process's by-reference readers open the store as a trainer does
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
        tls_row = measure_tls(count, rounds, env, work)
        print(f"  ingest with mutual TLS: {tls_row['tls_ingest_fragments_per_s']:.1f} frag/s, plaintext "
              f"{tls_row['plaintext_ingest_fragments_per_s']:.1f} frag/s (alternating rounds): "
              f"{tls_row['throughput_cost']:.0%} of the throughput, {tls_row['cpu_cost']:.0%} of the CPU per "
              f"fragment (target <= 10% of the throughput: "
              f"{'met' if tls_row['within_target'] else 'NOT met'})", flush=True)
    finally:
        stop(redis_proc)
        stop(s3_proc)
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - started
    mb = len(blob) / 1e6
    print()
    print("frag/s (MB/s). sample: in-band (the front reads and streams the blobs); by ref: claimed over gRPC,"
          " blobs got from the store by the reader process, as bytes; reader: the trainer's reader by ref"
          " (blobs also parsed into SampledChunk). Each ratio is against the raw get measured right after it.")
    print(f"{'backend':<14}{'fronts':>7}{'ingest':>14}{'sample':>14}{'by ref':>14}{'reader':>14}{'raw put':>9}"
          f"{'raw get':>9}{'ingest/raw':>11}{'sample/raw':>11}{'ref/raw':>9}{'reader/raw':>11}")
    for r in rows:
        extra = (f"{r['raw_put_fragments_per_s']:>9.1f}{r['raw_get_fragments_per_s']:>9.1f}"
                 f"{r['ingest_vs_raw']:>11.0%}{r['sample_vs_raw']:>11.0%}{r['sample_refs_vs_raw']:>9.0%}"
                 f"{r['sample_reader_vs_raw']:>11.0%}" if "ingest_vs_raw" in r else "")
        rates = "".join(f"{r[k + '_fragments_per_s']:>7.1f} ({r[k + '_mb_per_s']:>4.0f})"
                        for k in ("ingest", "sample", "sample_refs", "sample_reader"))
        print(f"{r['backend']:<14}{r['fronts']:>7}{rates}{extra}")
    print("\nCPU ms per fragment (medians), by process role; raw rows: the same bytes without the service")
    roles = ["fronts", "clients", "s3", "redis"]
    print(f"{'backend':<14}{'fronts':>7}{'phase':>15}" + "".join(f"{x:>9}" for x in roles) + f"{'total':>9}{'raw/svc':>9}")
    for r in rows:
        for phase, cpu in r["cpu_ms_per_fragment"].items():
            versus = f"{phase}_cpu_vs_raw"
            ratio = f"{r[versus]:>9.0%}" if versus in r else ""
            print(f"{r['backend']:<14}{r['fronts']:>7}{phase:>15}" + "".join(f"{cpu[x]:>9.1f}" for x in roles)
                  + f"{sum(cpu.values()):>9.1f}{ratio}")
    # Sampling by reference is the trainer's default with S3: that is the sample path judged (as bytes, like
    # the raw gets); the in-band path and the trainer's reader (which also parses) are reported beside it.
    service = [r for r in rows if "ingest_vs_raw" in r]
    ratios = [min(r["ingest_vs_raw"], r["sample_refs_vs_raw"]) for r in service]
    cpu_ratios = [min(r["ingest_cpu_vs_raw"], r["sample_refs_cpu_vs_raw"]) for r in service]
    in_band = min(r["sample_vs_raw"] for r in service)
    reader = min(r["sample_reader_vs_raw"] for r in service)
    target_met = min(ratios) >= 0.7
    print(f"\nfragment: {mb:.2f} MB ({LENGTH} steps of 64x64x3 uint8); MB/s = frag/s x {mb:.2f}. "
          f"Redis+S3 path vs raw, worst of ingest/sample by ref and 1/2 fronts: {min(ratios):.0%} by throughput, "
          f"{min(cpu_ratios):.0%} by CPU per fragment (target >= 70%: {'met' if target_met else 'NOT met'}; "
          f"sample in-band: {in_band:.0%}, trainer's reader: {reader:.0%}); "
          f"{elapsed:.0f}s on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        **provenance(),
        "benchmark": "replay_buffer", "fragment_bytes": len(blob), "fragment_length": LENGTH,
        "fragments_per_round": count, "rounds": rounds, "streams_per_front": STREAMS_PER_FRONT,
        "readers_per_front": READERS_PER_FRONT, "chunks_per_sample": CHUNKS_PER_SAMPLE, "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0], "s3_server": "moto_server (loopback)",
        # Scalars per configuration, for bench/report.py (which skips lists); full detail in "results".
        "summary": {f"{r['backend']} {r['fronts']} front{'s' if r['fronts'] > 1 else ''}": {
            k: round(v, 3) for k, v in r.items() if isinstance(v, float)} for r in rows},
        "results": rows,
        "tls_ingest": tls_row,
        # Worst over 1 and 2 fronts of ingest and sample by reference (the trainer's path with S3).
        "worst_ratio_vs_raw": min(ratios), "worst_cpu_ratio_vs_raw": min(cpu_ratios),
        "worst_in_band_sample_ratio_vs_raw": in_band, "worst_reader_sample_ratio_vs_raw": reader,
        "target_ratio": 0.7, "target_met": target_met,
        "seconds": round(elapsed, 1)}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def print_row(r: dict) -> None:
    print(f"  {r['backend']:<13} fronts={r['fronts']} ingest {r['ingest_fragments_per_s']:.1f} frag/s "
          f"({r['ingest_mb_per_s']:.0f} MB/s), sample {r['sample_fragments_per_s']:.1f} frag/s "
          f"({r['sample_mb_per_s']:.0f} MB/s), by ref {r['sample_refs_fragments_per_s']:.1f} frag/s "
          f"({r['sample_refs_mb_per_s']:.0f} MB/s), reader {r['sample_reader_fragments_per_s']:.1f} frag/s "
          f"({r['sample_reader_mb_per_s']:.0f} MB/s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
