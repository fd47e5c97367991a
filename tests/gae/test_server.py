from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from overworld.core.grpc_util import Server, serve, wait_healthy
from overworld.gae.client import GaeClient
from overworld.gae.server import GaeService
from overworld.v1 import gae_pb2, gae_pb2_grpc


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
    wait_healthy(s.address, service="overworld.v1.Gae")
    yield s
    s.stop(0)


def batch(B: int = 3, T: int = 8) -> dict[str, np.ndarray]:
    return {"reward": np.ones((B, T), np.float32), "value": np.zeros((B, T), np.float32),
            "bootstrap_value": np.zeros((B, T), np.float32), "terminated": np.zeros((B, T), bool),
            "truncated": np.zeros((B, T), bool), "next_value": np.zeros(B, np.float32)}


def test_estimate_over_a_socket(server: Server) -> None:
    adv, target = GaeClient(server.address).estimate(batch(), 0.5, 1.0)
    assert adv.shape == (3, 8)
    assert adv[0, -1] == pytest.approx(1.0) and adv[0, 0] == pytest.approx(2.0 - 0.5**7, rel=1e-5)
    np.testing.assert_allclose(target, adv)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda b: b.pop("value"), "missing tensors: value"),
    (lambda b: b.__setitem__("reward", np.ones((3, 9), np.float32)), "shape"),
    (lambda b: b.__setitem__("terminated", np.zeros((3, 8), np.float32)), "dtype"),
    (lambda b: b.__setitem__("value", np.full((3, 8), np.nan, np.float32)), "NaN"),
])
def test_bad_input_is_invalid_argument_and_server_stays_up(server: Server, mutate, message: str) -> None:
    b = batch()
    mutate(b)
    client = GaeClient(server.address)
    with pytest.raises(grpc.RpcError) as err:
        client.estimate(b, 0.9, 0.9)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.call("Estimate", gae_pb2.EstimateRequest(discount=0.9, gae_lambda=0.9, tensors=b"not safetensors"),
                    timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        client.estimate(batch(), 1.5, 0.9)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.estimate(batch(), 0.9, 0.9)[0].shape == (3, 8)
    client.close()


def test_vtrace_over_a_socket_honours_lambda_and_clip_thresholds(server: Server) -> None:
    from overworld.gae.advantage import vtrace

    rng = np.random.default_rng(0)
    b = batch()
    b["reward"] = rng.normal(size=(3, 8)).astype(np.float32)
    b["behaviour_logp"] = rng.normal(-1, 0.5, (3, 8)).astype(np.float32)
    b["target_logp"] = rng.normal(-1, 0.5, (3, 8)).astype(np.float32)
    adv, target = GaeClient(server.address).estimate(b, 0.9, 0.7, vtrace=True, rho_clip=2.0, c_clip=0.5)
    local = {k: v for k, v in b.items() if k not in ("behaviour_logp", "target_logp")}
    want_adv, want_target = vtrace(**local, behaviour_logp=b["behaviour_logp"], target_logp=b["target_logp"],
                                   discount=0.9, gae_lambda=0.7, rho_clip=2.0, c_clip=0.5)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-6)
    np.testing.assert_allclose(target, want_target, rtol=1e-6)
    with GaeClient(server.address) as client, pytest.raises(grpc.RpcError) as err:
        client.estimate(b, 0.9, 1.5, vtrace=True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gae_lambda" in err.value.details()
