"""A service refuses a call by raising Refused anywhere below its handler; every server built by
`serve` answers it with that status and message: before a unary reply, before a stream's first
response, in the middle of a stream, and for handlers that take raw bytes. No service aborts inline."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from overworld.core.grpc_util import Refused, serve

SERVICES = Path(__file__).resolve().parents[2] / "services" / "overworld"
NAME = "test.Refusals"


def _refuse_unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    if request == b"bad":
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "bad is not a request")
    return b"ok:" + request


def _refuse_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    if request == b"first":
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "refused before any response")
    yield b"one"
    raise Refused(grpc.StatusCode.UNAVAILABLE, "refused after one response; retry")


def _register(_: object, server: grpc.Server) -> None:
    raw = {"request_deserializer": None, "response_serializer": None}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(NAME, {
        "Unary": grpc.unary_unary_rpc_method_handler(_refuse_unary, **raw),
        "Parsed": grpc.unary_unary_rpc_method_handler(_refuse_unary, request_deserializer=bytes,
                                                      response_serializer=bytes),
        "Stream": grpc.unary_stream_rpc_method_handler(_refuse_stream, **raw),
    })])


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    server = serve([(_register, None, NAME)])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield ch
    finally:
        server.stop(0)


@pytest.mark.parametrize("method", ["Unary", "Parsed"])
def test_a_unary_handler_that_raises_refused_answers_its_status(channel: grpc.Channel, method: str) -> None:
    call = channel.unary_unary(f"/{NAME}/{method}")
    assert call(b"x", timeout=10) == b"ok:x"
    with pytest.raises(grpc.RpcError) as err:
        call(b"bad", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "bad is not a request"


def test_a_stream_refused_before_or_after_its_first_response_ends_with_that_status(channel: grpc.Channel) -> None:
    call = channel.unary_stream(f"/{NAME}/Stream")
    with pytest.raises(grpc.RpcError) as err:
        list(call(b"first", timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    got: list[bytes] = []
    with pytest.raises(grpc.RpcError) as err:
        for response in call(b"later", timeout=10):
            got.append(response)
    assert got == [b"one"]
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, "refused after one response; retry")


def test_no_service_aborts_inline() -> None:
    """context.abort only where gRPC's plumbing answers for every service (grpc_util, authz)."""
    inline = [f"{path.relative_to(SERVICES)}:{n}" for path in sorted(SERVICES.rglob("*.py"))
              if path.name not in ("grpc_util.py", "authz.py") and "v1" not in path.parts
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"(\bcontext\.abort|\babort\(\s*(self\.)?context)\b", line)]
    assert inline == []
