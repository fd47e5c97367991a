"""One client shape (core/client.py): every service's client is a `ServiceClient`, its stub is private,
"how long" is spelled `timeout=`, and tests, benchmarks and the rehearsal reach a service through its client only:
none builds a gRPC stub or reaches one (`ServiceClient.call` is their one way to send a request built by
hand). core/grpc_util.py keeps one retry helper, `Retry`."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import grpc

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
# Streams that live as long as their caller has something to send, without a deadline of their own
# (`timeout=None` by default): a peer that went away is found by the channel's keepalive (core/grpc_util.py).
OPEN_ENDED = {"ReplayBufferClient.insert"}
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


def sends_a_request(method: object) -> bool:
    """Whether a client method's own code sends a request (through its stub or `call`)."""
    source = inspect.getsource(method)  # type: ignore[arg-type]
    return "self._stub." in source or "self.call(" in source


def timeout_problem(name: str, method_name: str, method: object) -> str | None:
    """Why a public client method does not have the one shape, or None: a method that sends a request
    takes `timeout=` (keyword-only, required or with a finite positive default: no call waits for ever)."""
    parameters = inspect.signature(method).parameters  # type: ignore[arg-type]
    if {"deadline", "retried", "retry"} & set(parameters):
        return f"{name}.{method_name}: say timeout="
    timeout = parameters.get("timeout")
    if timeout is None:
        return f"{name}.{method_name} sends a request without timeout=" if sends_a_request(method) else None
    if timeout.kind is not inspect.Parameter.KEYWORD_ONLY:
        return f"{name}.{method_name}: timeout is keyword-only"
    default = timeout.default
    if default is inspect.Parameter.empty or (default is None and f"{name}.{method_name}" in OPEN_ENDED):
        return None  # the caller says how long, or a stream guarded by keepalive
    if not isinstance(default, int | float) or not 0 < default < float("inf"):
        return f"{name}.{method_name}: timeout needs a finite default, not {default!r}"
    return None


def test_the_shape_check_finds_a_method_without_a_bounded_timeout() -> None:
    class Client(ServiceClient):
        def untimed(self, request: object) -> object:
            return self._stub.Get(request)

        def positional(self, request: object, timeout: float = 5.0) -> object:
            return self.call("Get", request, timeout=timeout)

        def forever(self, request: object, *, timeout: float | None = None) -> object:
            return self.call("Get", request, timeout=timeout or 1.0)

        def fine(self, request: object, *, timeout: float = 5.0) -> object:
            return self.call("Get", request, timeout=timeout)

        def local(self) -> int:
            return 1

    found = {m: timeout_problem("Client", m, getattr(Client, m)) for m in ("untimed", "positional", "forever",
                                                                             "fine", "local")}
    assert found["untimed"] and found["positional"] and found["forever"], found
    assert found["fine"] is None and found["local"] is None


def test_every_service_client_has_the_one_shape() -> None:
    for package, name in CLIENTS.items():
        cls = getattr(importlib.import_module(f"overworld.{package}.client"), name)
        assert issubclass(cls, ServiceClient), f"{name} is not a ServiceClient"
        client = cls("127.0.0.1:1")  # a channel connects on its first call: nothing is reached here
        try:
            assert client.address == "127.0.0.1:1" and repr(client) == f"{name}('127.0.0.1:1')"
            exposed = {attr: type(value).__name__ for attr, value in vars(client).items()
                       if not attr.startswith("_")
                       and (isinstance(value, grpc.Channel) or type(value).__name__.endswith("Stub"))}
            assert not exposed, f"{name} exposes its channel or stub: {exposed}"
            with client as entered:
                assert entered is client
        finally:
            client.close()
        sending = 0
        for method_name, method in inspect.getmembers(cls, inspect.isfunction):
            if method_name.startswith("_") or method_name == "call":
                continue
            problem = timeout_problem(name, method_name, method)
            assert problem is None, problem
            sending += sends_a_request(method)
        assert sending, f"{name}: no public method sends a request (the check found nothing to check)"


def test_one_retry_helper() -> None:
    """core/grpc_util.Retry is the one way to retry a call: no other retry class or function is defined
    in the services."""
    helpers = []
    for path in sorted((ROOT / "services" / "overworld").rglob("*.py")):
        if "/v1/" in path.as_posix():
            continue
        for match in re.finditer(r"^\s*(?:def|class) (\w*retr(?:y|ied)(?:_\w*)?)\b", path.read_text(), re.M | re.I):
            helpers.append(f"{path.relative_to(ROOT)}: {match[1]}")
    assert helpers == ["services/overworld/core/grpc_util.py: Retry"], helpers
