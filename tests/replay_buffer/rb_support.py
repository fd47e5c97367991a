"""Helpers for the replay-buffer tests: fragments, backends, fronts on real gRPC sockets, clients.

The wire-level helpers (`insert`, `insert_until_error`, `sample`, `stats`) take a front's
ReplayBufferClient: `sample` sends its SampleRequest as built here (`ServiceClient.call`, one attempt),
so that tests see the front's own answers (a partial sample, DEADLINE_EXCEEDED)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from overworld.core.blobs.store import BlobStore, LocalBlobStore
from overworld.core.config import ReplayBufferConfig
from overworld.core.grpc_util import Server, serve
from overworld.core.net import free_port  # noqa: F401 (used by the tests)
from overworld.core.specs import Spaces, TensorSpec
from overworld.core.wire.fragment import Fragment, expected_tensors
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.replay_buffer.index import MemoryIndex, ReplayIndex
from overworld.replay_buffer.rate_limiter import RateLimiter
from overworld.replay_buffer.server import ReplayBufferService, add_to_server
from overworld.v1 import common_pb2, replay_buffer_pb2, replay_buffer_pb2_grpc

SPACES = Spaces(obs={"rgb": TensorSpec((4, 4, 3), "uint8")}, action={"action": TensorSpec((), "int64")})
LENGTH = 8
BUCKET = "overworld-test"
# Fast housekeeping so that deferred deletes and metrics show up within a test (ref_grace 0: blobs of
# chunks that left are deleted after delete_delay; test_blob_refs.py sets its own).
SERVICE_DEFAULTS: dict[str, Any] = {"delete_delay": 0.1, "ref_grace": 0.0, "sweep_interval": 0.0,
                                    "metrics_interval": 0.2, "default_sample_timeout": 5.0}




def new_run_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def fragment_data(spaces: Spaces, length: int, version: int = 0, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = {}
    for name, (shape, dtype) in expected_tensors(spaces, length).items():
        if np.dtype(dtype) == np.uint8:
            data[name] = rng.integers(0, 255, size=shape, dtype=np.uint8)
        else:
            data[name] = np.zeros(shape, dtype=dtype)
    data["model_version"] = np.full((length,), version, dtype=np.int64)
    data["reward"] = np.full((length,), float(seed), dtype=np.float32)
    return data


def make_fragment(run_id: str, worker: str = "w1", slot: int = 0, seq: int = 0, version: int = 0,
                  length: int = LENGTH, spaces: Spaces = SPACES, data: dict[str, np.ndarray] | None = None
                  ) -> common_pb2.Fragment:
    if data is None:
        data = fragment_data(spaces, length, version, seed=seq)
    return Fragment(run_id, worker, slot, seq, data).to_proto()


def requests(fragments: Iterable[common_pb2.Fragment]) -> Iterator[replay_buffer_pb2.InsertRequest]:
    for f in fragments:
        yield replay_buffer_pb2.InsertRequest(fragment=f)


def insert(client: ReplayBufferClient, fragments: Iterable[common_pb2.Fragment], timeout: float = 20.0
           ) -> list[replay_buffer_pb2.InsertResponse]:
    return list(client.insert(requests(fragments), timeout=timeout))


def insert_until_error(client: ReplayBufferClient, fragments: Iterable[common_pb2.Fragment], timeout: float = 20.0
                       ) -> tuple[list[replay_buffer_pb2.InsertResponse], grpc.RpcError | None]:
    acks = []
    try:
        for ack in client.insert(requests(fragments), timeout=timeout):
            acks.append(ack)
    except grpc.RpcError as err:
        return acks, err
    return acks, None


def sample(client: ReplayBufferClient, n: int, timeout: float = 2.0, allow_partial: bool = False,
           reader: str = "test", blob_refs: bool = False) -> list[replay_buffer_pb2.SampledChunk]:
    """One Sample call as sent (the front waits up to `timeout` for the chunks; not retried)."""
    request = replay_buffer_pb2.SampleRequest(num_chunks=n, timeout_seconds=timeout, allow_partial=allow_partial,
                                              reader_id=reader, blob_refs=blob_refs)
    return list(client.call("Sample", request, timeout=timeout + 30))


def stats(client: ReplayBufferClient) -> replay_buffer_pb2.BufferStats:
    """The front's counters, one attempt (a test that stops a backend sees the front's answer)."""
    return client.call("GetStats", replay_buffer_pb2.GetStatsRequest(), timeout=10)


def wait_until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Backend:
    """memory index + local blobs, or Redis index + S3 blobs (real servers on loopback)."""

    name: str
    workdir: Path
    redis_url: str = ""
    s3: dict[str, str] = field(default_factory=dict)
    _memory: dict[str, MemoryIndex] = field(default_factory=dict)

    @property
    def index_url(self) -> str:
        return self.redis_url if self.name == "redis" else "memory"

    @property
    def durable(self) -> bool:
        return self.name == "redis"

    def blobs_url(self, run_id: str) -> str:
        return f"s3://{BUCKET}/{run_id}" if self.name == "redis" else str(self.workdir / run_id)

    def index(self, run_id: str, rb: ReplayBufferConfig, seed: int = 0) -> ReplayIndex:
        limiter = RateLimiter.create(rb.samples_per_insert, rb.samples_per_insert_error, rb.min_size_to_sample,
                                     rb.max_reuse)
        if self.name == "memory":
            # Fronts of one run share the in-process index (the embedded backend is one process).
            if run_id not in self._memory:
                self._memory[run_id] = MemoryIndex(rb.max_chunks, rb.max_reuse, rb.max_staleness,
                                                   rb.fragments_per_chunk, limiter, seed=seed,
                                                   sample_order=rb.sample_order)
            return self._memory[run_id]
        from overworld.replay_buffer.redis_index import RedisIndex

        return RedisIndex.from_url(self.redis_url, run_id, rb, limiter, seed=seed)

    def blobs(self, run_id: str) -> BlobStore:
        if self.name == "memory":
            return LocalBlobStore(self.blobs_url(run_id))
        from overworld.core.blobs.s3 import S3BlobStore

        return S3BlobStore.from_url(self.blobs_url(run_id), endpoint=self.s3["OVERWORLD_S3_ENDPOINT"],
                                    access_key=self.s3["OVERWORLD_S3_ACCESS_KEY"],
                                    secret_key=self.s3["OVERWORLD_S3_SECRET_KEY"])


@dataclass
class Front:
    service: ReplayBufferService
    server: Server
    index: ReplayIndex
    blobs: BlobStore
    client: ReplayBufferClient

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        self.client.close()
        self.service.stop()
        self.server.stop(0.5)
        if not isinstance(self.index, MemoryIndex):
            self.index.close()


@dataclass
class Buffer:
    """One run's replay buffer: a backend and the fronts serving it."""

    backend: Backend
    run_id: str
    rb: ReplayBufferConfig
    fragment_length: int
    spaces: Spaces
    service_kwargs: dict[str, Any]
    fronts: list[Front] = field(default_factory=list)

    def add_front(self, generated: bool = False, port: int = 0, **overrides: Any) -> Front:
        """A front on a real gRPC port (`port`, else a free one); registered with `server.add_to_server`
        (the bytes fast path), or with the generated `add_ReplayBufferServicer_to_server` when `generated`."""
        index = self.backend.index(self.run_id, self.rb)
        blobs = self.backend.blobs(self.run_id)
        kwargs = {**self.service_kwargs, **overrides}
        service = ReplayBufferService(index, blobs, self.run_id, self.fragment_length, self.rb.fragments_per_chunk,
                                      self.rb.max_chunks, lambda: self.spaces, self.rb.max_fragment_bytes, **kwargs)
        add = replay_buffer_pb2_grpc.add_ReplayBufferServicer_to_server if generated else add_to_server
        server = serve([(add, service, "overworld.v1.ReplayBuffer")], "127.0.0.1", port)
        front = Front(service, server, index, blobs, ReplayBufferClient(server.address))
        self.fronts.append(front)
        return front

    @property
    def front(self) -> Front:
        return self.fronts[0]

    @property
    def client(self) -> ReplayBufferClient:
        return self.fronts[0].client

    def fragment(self, **kwargs: Any) -> common_pb2.Fragment:
        kwargs.setdefault("length", self.fragment_length)
        kwargs.setdefault("spaces", self.spaces)
        return make_fragment(self.run_id, **kwargs)

    def blob_keys(self) -> list[str]:
        from overworld.replay_buffer.server import fragments_prefix

        return self.front.blobs.keys(fragments_prefix(self.run_id))

    def close(self) -> None:
        for front in self.fronts:
            front.stop()
        self.fronts.clear()


def make_rb_config(**kwargs: Any) -> ReplayBufferConfig:
    defaults: dict[str, Any] = {"max_chunks": 100, "max_reuse": 1, "max_staleness": 100, "fragments_per_chunk": 1}
    return dataclasses.replace(ReplayBufferConfig(), **{**defaults, **kwargs})


def start_front_process(manager: str, index_url: str, blobs_url: str, port: int, metrics_port: int,
                        env: dict[str, str], log: Path) -> subprocess.Popen:
    """`overworld serve replay-buffer` as a real process (what a pod runs)."""
    full_env = {**os.environ, **env, "OVERWORLD_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1"}
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        full_env.pop(var, None)
    root = Path(__file__).resolve().parents[2]
    full_env["PYTHONPATH"] = os.pathsep.join([str(root / "services"), full_env.get("PYTHONPATH", "")])
    args = [sys.executable, "-m", "overworld.cli", "serve", "replay-buffer", "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", str(metrics_port), "--rollout-manager", manager,
            "--index", index_url, "--blobs", blobs_url]
    return subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=full_env)
