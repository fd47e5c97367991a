"""Defects the fuzzer found, each pinned by a test that failed before its fix."""

from __future__ import annotations

import grpc

from overworld.core.grpc_util import channel
from overworld.core.security import tls
from tests.security.services_in_one_process import Fleet


def _identity(b: bytes) -> bytes:
    return b


def test_undecodable_requests_get_invalid_argument_and_leak_no_memory(fleet: Fleet) -> None:
    """gRPC answered bytes that are not the request message with INTERNAL "Exception deserializing
    request!" and kept ~19 KB of the server's memory per such call (110 MB after 6,000): now
    INVALID_ARGUMENT naming the method, and memory stays flat."""
    assert fleet.credentials is not None
    tls.use(fleet.credentials["operator"])
    try:
        with channel(fleet.addresses["replay-buffer"], "replay-buffer") as ch:
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


def test_a_fetch_cannot_ask_for_a_message_per_byte(fleet: Fleet) -> None:
    """FetchRequest(chunk_size=1) made the registry send the version one byte per message (37,849
    messages, 12 s, for the CartPole policy; hours for a large model): now INVALID_ARGUMENT saying
    which chunk sizes work, and the registry's own chunking is untouched."""
    from overworld.v1 import model_registry_pb2 as pb
    from tests.fuzz.goods import model_registry as publish_a_version

    publish_a_version(fleet)
    assert fleet.credentials is not None
    tls.use(fleet.credentials["rollout-worker"])
    try:
        with channel(fleet.addresses["model-registry"], "model-registry") as ch:
            fetch = ch.unary_stream("/overworld.v1.ModelRegistry/Fetch", request_serializer=pb.FetchRequest.SerializeToString,
                                    response_deserializer=pb.WeightsChunk.FromString)
            try:
                list(fetch(pb.FetchRequest(chunk_size=1), timeout=10))
                raise AssertionError("a message per byte was sent")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
                assert "chunk_size 1" in (err.details() or "") and "use 0" in (err.details() or "")
            assert len(list(fetch(pb.FetchRequest(chunk_size=4096), timeout=30))) > 2  # a workable size
    finally:
        tls.reset()
