"""Every RPC of every service, fed hostile input over real sockets (mutual TLS, each RPC called by an
identity allowed to call it, so the input reaches the servicer): random and truncated bytes, messages
with extreme fields, lying tensor payloads, streams cut by the client. Every case must end with a gRPC
status a person can act on (never UNKNOWN, an unhandled exception), the service must stay healthy and
accept good data afterwards, and the fleet's memory must stay bounded.

Profiles: a quick one (QUICK_CASES per RPC) in `make test-fast`; the full one (FULL_CASES per RPC,
marked slow). A case is one call; Hypothesis draws a message per BATCH cases and derives the rest from
it (truncations, corrupted bytes, trailing garbage, repeats, random bytes). Calls are pipelined
(IN_FLIGHT at once), so RPCs that wait by design (Watch, Sample, GetPushStatus) cost their short
deadline once per batch, not per case.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from overworld.core.grpc_util import channel, wait_healthy
from overworld.core.security import authz, tls
from overworld.v1 import replay_buffer_pb2
from rehearsal.rpcs import RPCS, Rpc
from tests.fuzz.goods import GOOD_DATA
from tests.fuzz.strategies import BATCH, batches
from tests.security.services_in_one_process import Fleet

QUICK_CASES = int(os.environ.get("OVERWORLD_FUZZ_QUICK", "40"))
FULL_CASES = int(os.environ.get("OVERWORLD_FUZZ_FULL", "2000"))
IN_FLIGHT = 32
# Generous: what is checked is that each case ends with a status a person can act on, not how fast;
# 5 s proved tight for 32 calls in flight on a loaded 2-core CI machine.
DEADLINE = 30.0
# RPCs that wait by design for data or an event: their deadline is short and DEADLINE_EXCEEDED is their answer.
WAITING = {"Watch": 0.3, "WatchAnnouncements": 0.3, "Sample": 0.3, "GetPushStatus": 0.3}
RSS_GROWTH_LIMIT = 384 << 20
REPORT = Path(os.environ.get("OVERWORLD_FUZZ_REPORT", "")) if os.environ.get("OVERWORLD_FUZZ_REPORT") else None


def _identity(b: bytes) -> bytes:
    return b


def wait(call: Any, rpc: Rpc) -> None:
    """Until the call ends (its status is then in call.code())."""
    with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError):
        if rpc.server_streaming:
            for _ in call:
                pass
        else:
            call.result()


class Pipeline:
    """Issues calls without waiting for them (up to IN_FLIGHT), checks each status as it completes."""

    def __init__(self, ch: grpc.Channel, rpc: Rpc) -> None:
        kind = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
                (True, True): "stream_stream"}[(rpc.client_streaming, rpc.server_streaming)]
        self.method = getattr(ch, kind)(rpc.path, request_serializer=_identity, response_deserializer=_identity)
        self.rpc = rpc
        self.deadline = WAITING.get(rpc.name, DEADLINE)
        self.pending: collections.deque[tuple[Any, list[bytes], bool]] = collections.deque()
        self.codes: collections.Counter[str] = collections.Counter()
        self.cases = 0

    def submit(self, messages: list[bytes], cancel: bool) -> None:
        request: Any = iter(messages) if self.rpc.client_streaming else messages[0]
        call = (self.method(request, timeout=self.deadline) if self.rpc.server_streaming
                else self.method.future(request, timeout=self.deadline))
        if cancel:
            call.cancel()
        self.pending.append((call, messages, cancel))
        self.cases += 1
        while len(self.pending) > IN_FLIGHT:
            self.check(*self.pending.popleft())

    def check(self, call: Any, messages: list[bytes], cancel: bool) -> None:
        wait(call, self.rpc)
        code, details = call.code(), call.details() or ""
        self.codes[code.name] += 1
        where = f"{self.rpc} answered {code.name} {details!r} to {[m[:200] for m in messages]!r}"
        assert code != grpc.StatusCode.UNKNOWN, "an unhandled exception in the servicer: " + where
        assert code != grpc.StatusCode.PERMISSION_DENIED, where  # the caller is allowed this RPC
        assert code != grpc.StatusCode.INTERNAL, where  # bytes that are no message: INVALID_ARGUMENT
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            assert self.rpc.name in WAITING, "no answer within the deadline: " + where
        if code == grpc.StatusCode.CANCELLED:
            assert cancel, where
        assert details or code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED,
                                   grpc.StatusCode.DEADLINE_EXCEEDED), "a status without a message: " + where

    def drain(self) -> None:
        while self.pending:
            self.check(*self.pending.popleft())


def rss_baseline(fleet: Fleet, _cache: dict[int, int] = {}) -> int:  # noqa: B006 - per-fleet memo
    return _cache.setdefault(fleet.proc.pid, fleet.rss_bytes())


def fuzz(fleet: Fleet, rpc: Rpc, cases: int) -> Pipeline:
    assert fleet.credentials is not None
    baseline = rss_baseline(fleet)
    caller = authz.callers(rpc.path)[0]
    tls.use(fleet.credentials[caller])
    ch = channel(fleet.addresses[rpc.service], rpc.service)
    pipeline = Pipeline(ch, rpc)

    # Each example is a batch of BATCH cases derived from one drawn message (the draw is the costly part).
    @settings(max_examples=-(-cases // BATCH), deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(batch=batches(rpc.request_type, rpc.client_streaming))
    def one(batch: list[tuple[list[bytes], bool]]) -> None:
        for case in batch:
            pipeline.submit(*case)

    try:
        one()
        pipeline.drain()
        # Still healthy, still doing its job, memory bounded.
        wait_healthy(fleet.addresses[rpc.service], 30, peer=rpc.service)
        GOOD_DATA[rpc.service](fleet)
        grown = fleet.rss_bytes() - baseline
        assert grown < RSS_GROWTH_LIMIT, f"the fleet grew by {grown >> 20} MiB fuzzing {rpc}"
    finally:
        ch.close()
        tls.reset()
    if REPORT:
        with REPORT.open("a") as f:
            f.write(json.dumps({"rpc": rpc.path, "cases": pipeline.cases, "codes": dict(pipeline.codes),
                                "rss_growth_mib": round((fleet.rss_bytes() - baseline) / 2**20, 1)}) + "\n")
    return pipeline


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_quick(fleet: Fleet, rpc: Rpc) -> None:
    assert fuzz(fleet, rpc, QUICK_CASES).cases >= QUICK_CASES


@pytest.mark.slow
@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_full(fleet: Fleet, rpc: Rpc) -> None:
    assert fuzz(fleet, rpc, FULL_CASES).cases >= FULL_CASES


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/overworld.v1.ReplayBuffer/Insert", "/overworld.v1.ModelRegistry/Watch",
                                  "/overworld.v1.ReplayBuffer/Sample"])
def test_thousands_of_concurrent_streams_from_one_client(fleet: Fleet, path: str) -> None:
    """2,000 streams at once on one channel, each left open (nothing sent, nothing read): every one
    ends with a status by its deadline, and the service is healthy and useful afterwards."""
    assert fleet.credentials is not None
    rpc = next(r for r in RPCS if r.path == path)
    baseline = rss_baseline(fleet)
    tls.use(fleet.credentials[authz.callers(path)[0]])
    ch = channel(fleet.addresses[rpc.service], rpc.service)
    pipeline = Pipeline(ch, rpc)
    pipeline.deadline = 3.0
    never = threading.Event()

    def silent() -> Any:
        never.wait(10)
        return
        yield  # a request stream that sends nothing

    try:
        calls = []
        # A request that waits (Sample: more chunks than the buffer holds, until the deadline).
        waiting = replay_buffer_pb2.SampleRequest(num_chunks=64, timeout_seconds=30).SerializeToString()
        for _ in range(2000):
            request: Any = silent() if rpc.client_streaming else waiting if rpc.name == "Sample" else b""
            calls.append(pipeline.method(request, timeout=pipeline.deadline) if rpc.server_streaming
                         else pipeline.method.future(request, timeout=pipeline.deadline))
        started = time.monotonic()
        codes = collections.Counter()
        for call in calls:
            wait(call, rpc)
            codes[call.code().name] += 1
            assert call.code() != grpc.StatusCode.UNKNOWN, call.details()
        assert time.monotonic() - started < 60
        never.set()
        wait_healthy(fleet.addresses[rpc.service], 60, peer=rpc.service)
        GOOD_DATA[rpc.service](fleet)
        assert fleet.rss_bytes() - baseline < RSS_GROWTH_LIMIT
        if REPORT:
            with REPORT.open("a") as f:
                f.write(json.dumps({"rpc": path, "concurrent_streams": 2000, "codes": dict(codes)}) + "\n")
    finally:
        never.set()
        ch.close()
        tls.reset()
