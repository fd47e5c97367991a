"""Defects the fuzzer found, each pinned by a test that failed before its fix."""

from __future__ import annotations

import grpc

from overworld.core import tls
from overworld.core.grpc_util import channel
from tests.security.fleet import Fleet


def _identity(b: bytes) -> bytes:
    return b


def test_undecodable_requests_get_invalid_argument_and_leak_no_memory(fleet: Fleet) -> None:
    """gRPC answered bytes that are not the request message with INTERNAL "Exception deserializing
    request!" and kept ~19 KB of the server's memory per such call (110 MB after 6,000): now
    INVALID_ARGUMENT naming the method, and memory stays flat."""
    assert fleet.credentials is not None
    tls.use(fleet.credentials["operator"])
    try:
        with channel(fleet.addresses["replay-buffer"]) as ch:
            stats = ch.unary_unary("/overworld.v1.ReplayBuffer/GetStats", request_serializer=_identity,
                                   response_deserializer=_identity)
            try:
                stats(b"\xff\xff\xff", timeout=10)
                raise AssertionError("undecodable bytes accepted")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
                assert "/overworld.v1.ReplayBuffer/GetStats" in (err.details() or "")
            before = fleet.rss_bytes()
            pending = []
            for _ in range(6000):
                pending.append(stats.future(b"\xff\xff\xff", timeout=30))
                if len(pending) >= 32:
                    assert pending.pop(0).code() == grpc.StatusCode.INVALID_ARGUMENT
            for call in pending:
                assert call.code() == grpc.StatusCode.INVALID_ARGUMENT
            grown = fleet.rss_bytes() - before
            assert grown < 24 << 20, f"6,000 undecodable requests kept {grown >> 20} MiB"
    finally:
        tls.reset()
