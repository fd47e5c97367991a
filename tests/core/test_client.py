"""ServiceClient (core/client.py), the base of every service's client: its address, its channel (its own,
or one made elsewhere that it leaves open), `call` and the one `timeout=` (retries included)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from overworld.core import grpc_util
from overworld.core.grpc_util import Server, serve, wait_healthy
from overworld.gae.client import GaeClient
from overworld.gae.server import GaeService
from overworld.v1 import gae_pb2, gae_pb2_grpc
from tests.support import free_port


@pytest.fixture(scope="module")
def gae() -> Iterator[Server]:
    server = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
    wait_healthy(server.address)
    yield server
    server.stop(0)


def batch() -> dict[str, np.ndarray]:
    return {"reward": np.ones((1, 4), np.float32), "value": np.zeros((1, 4), np.float32),
            "bootstrap_value": np.zeros((1, 4), np.float32), "terminated": np.zeros((1, 4), bool),
            "truncated": np.zeros((1, 4), bool), "next_value": np.zeros(1, np.float32)}


def test_address_repr_and_a_context_manager_that_closes_its_channel(gae: Server) -> None:
    with GaeClient(gae.address) as client:
        assert client.address == gae.address and repr(client) == f"GaeClient({gae.address!r})"
        with pytest.raises(AttributeError):
            client.address = "elsewhere:1"  # type: ignore[misc]
        assert client.estimate(batch(), 0.9, 0.9)[0].shape == (1, 4)
    with pytest.raises(ValueError):  # grpc: "Cannot invoke RPC on closed channel!"
        client.estimate(batch(), 0.9, 0.9, timeout=1)


def test_a_channel_made_elsewhere_stays_open_after_close(gae: Server) -> None:
    with grpc.insecure_channel(gae.address) as channel:
        client = GaeClient("through-a-port-forward:1", channel=channel)
        client.close()
        assert client.address == "through-a-port-forward:1"
        assert client.estimate(batch(), 0.9, 0.9)[0].shape == (1, 4)  # the call went over `channel`


def test_call_sends_a_request_as_built_once(gae: Server) -> None:
    with GaeClient(gae.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.call("Estimate", gae_pb2.EstimateRequest(tensors=b"not safetensors"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for name in ("Nothing", "close", "_stub"):
            with pytest.raises(AttributeError):
                client.call(name, gae_pb2.EstimateRequest(), timeout=1)


def test_timeout_bounds_a_retried_call_retries_included() -> None:
    with GaeClient(f"127.0.0.1:{free_port()}") as client:  # nothing listens: UNAVAILABLE, retried
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.estimate(batch(), 0.9, 0.9, timeout=1.0)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert 0.5 < time.monotonic() - started < 5.0


def failed(call: str) -> float:
    return grpc_util.CALLS_FAILED.labels(call)._value.get()


def retried(call: str) -> float:
    return grpc_util.CALL_RETRIES.labels(call)._value.get()


def test_a_call_that_gave_up_is_a_failure_and_one_a_retry_absorbed_is_retries() -> None:
    with GaeClient(f"127.0.0.1:{free_port()}") as client:
        before = failed("gae.Estimate")
        with pytest.raises(grpc.RpcError):
            client.estimate(batch(), 0.9, 0.9, timeout=0.5)
        assert failed("gae.Estimate") == before + 1
    # a service back after two attempts (a restart, a hand-over): the caller never sees it fail
    before, retries = failed("gae.Estimate"), retried("gae.Estimate")
    attempts: list[float] = []

    def flaky(left: float) -> int:
        attempts.append(left)
        if len(attempts) < 3:
            raise FakeUnavailable()
        return 1

    assert grpc_util.Retry(5.0).run(flaky, "gae.Estimate") == 1 and len(attempts) == 3
    assert failed("gae.Estimate") == before and retried("gae.Estimate") == retries + 2


class FakeUnavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


def test_the_health_check_says_the_status() -> None:
    server = serve([])
    try:
        with grpc.insecure_channel(server.address) as channel:
            assert grpc_util.health_status(channel, timeout=5) == 1  # SERVING
            server.set_serving(False)
            assert grpc_util.health_status(channel, timeout=5) == 2  # NOT_SERVING
            assert not grpc_util.serving(channel)
    finally:
        server.stop(0)
