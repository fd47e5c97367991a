"""One client shape (core/client.py): every service's client is a `ServiceClient`, its stub is private,
"how long" is spelled `timeout=`, and tests, benchmarks and the rehearsal reach a service through its client only:
none builds a gRPC stub or reaches one (`ServiceClient.call` is their one way to send a request built by
hand). core/grpc_util.py keeps one retry helper, `Retry`."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

from overworld.core import grpc_util
from overworld.core.client import ServiceClient

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = {
    "gae": "GaeClient",
    "model_registry": "ModelRegistryClient",
    "replay_buffer": "ReplayBufferClient",
    "rollout_manager": "RolloutManagerClient",
    "rollout_worker": "RolloutWorkerClient",
    "trainer": "TrainerClient",
}
# Not held to the rule (paths relative to the repository):
EXEMPT = {
    # this file: it spells the patterns it looks for
    "tests/test_client_shape.py",
    # an attacker's pod: it calls every method of a service with a stolen identity, health-checks without
    # a client certificate, and must not lean on the clients it attacks
    "rehearsal/intruder.py",
}
BUILDS_A_STUB = re.compile(r"\b\w*Stub\(")  # ReplayBufferStub(channel), HealthStub(ch), ...
REACHES_A_STUB = re.compile(r"\.\w*stub\b")  # client.stub, cluster.buffer_stub, client._stub


def _exempt(path: Path) -> bool:
    relative = path.relative_to(ROOT).as_posix()
    return any(relative == e or relative.startswith(e + "/") for e in EXEMPT)


def stub_uses(text: str) -> list[str]:
    """The lines of `text` that build or reach a gRPC stub."""
    return [line.strip() for line in text.splitlines() if BUILDS_A_STUB.search(line) or REACHES_A_STUB.search(line)]


def test_the_check_finds_stubs_built_and_reached() -> None:
    assert stub_uses("stub = replay_buffer_pb2_grpc.ReplayBufferStub(channel(address))")
    assert stub_uses("health_pb2_grpc.HealthStub(ch).Check(request)")
    assert stub_uses("buf.stub.GetStats(request)") and stub_uses("insert(front.stub, frags)")
    assert stub_uses("cluster.buffer_stub.Sample(request)") and stub_uses("client._stub.Insert(requests)")
    assert not stub_uses('client.call("Sample", request, timeout=10)')
    assert not stub_uses("def test_generated_stubs_match_the_protos(tmp_path):")


def test_no_test_benchmark_or_rehearsal_builds_or_reaches_a_grpc_stub() -> None:
    found = []
    for folder in ("tests", "bench", "rehearsal"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not _exempt(path):
                found += [f"{path.relative_to(ROOT)}: {line}" for line in stub_uses(path.read_text())]
    assert not found, ("reach a service through its client (`<service>/client.py`; a request built by hand "
                       "through `ServiceClient.call`), not through a stub:\n" + "\n".join(found))


def test_every_service_client_has_the_one_shape() -> None:
    for package, name in CLIENTS.items():
        cls = getattr(importlib.import_module(f"overworld.{package}.client"), name)
        assert issubclass(cls, ServiceClient), f"{name} is not a ServiceClient"
        client = cls("127.0.0.1:1")  # a channel connects on its first call: nothing is reached here
        try:
            assert client.address == "127.0.0.1:1" and repr(client) == f"{name}('127.0.0.1:1')"
            assert not hasattr(client, "stub"), f"{name} exposes its stub"
            with client as entered:
                assert entered is client
        finally:
            client.close()
        for method_name, method in inspect.getmembers(cls, inspect.isfunction):
            if method_name.startswith("_"):
                continue
            parameters = inspect.signature(method).parameters
            assert not {"deadline", "retried", "retry"} & set(parameters), f"{name}.{method_name}: say timeout="
            if "timeout" in parameters:
                assert parameters["timeout"].kind is inspect.Parameter.KEYWORD_ONLY, (
                    f"{name}.{method_name}: timeout is keyword-only")


def test_one_retry_helper() -> None:
    assert hasattr(grpc_util, "Retry") and not hasattr(grpc_util, "retry")
