"""gRPC plumbing shared by every service: servers with health checking, channels, errors."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 512 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # A name that resolves to several addresses (a headless Service: one per ready pod) is
    # balanced call by call over all of them, and a dead pod's calls go to the others.
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.dns_min_time_between_resolutions_ms", 5_000),
]


# Clients ping every 30 s even when idle; without these a server answers an idle client's pings
# with GOAWAY "too_many_pings" after ~90 s and long-lived watch streams break.
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclass
class Server:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: list[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait(grace + 1)


# Replicated fronts (replay-buffer, gae) close each connection after this long (GOAWAY, then the
# grace for calls in flight): clients resolve the name again and spread over replicas added since.
FRONT_MAX_CONNECTION_AGE_S = 120.0
FRONT_MAX_CONNECTION_AGE_GRACE_S = 30.0


def serve(
    registrations: Iterable[tuple[Callable[[Any, grpc.Server], None], Any, str]],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 64,
    max_connection_age: float | None = None,
) -> Server:
    """Start a gRPC server with the given (add_XServicer_to_server, servicer, full_service_name) triples."""
    options = list(SERVER_OPTIONS)
    if max_connection_age:
        options += [("grpc.max_connection_age_ms", int(max_connection_age * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(FRONT_MAX_CONNECTION_AGE_GRACE_S * 1000))]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
    names = []
    for add, servicer, name in registrations:
        add(servicer, server)
        names.append(name)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    server.start()
    out = Server(server, bound, health_servicer, names)
    out.set_serving(True)
    return out


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def wait_healthy(address: str, timeout: float = 30.0, service: str = "") -> None:
    """Block until the server at `address` reports SERVING, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as err:
                last = err
            time.sleep(0.1)
    raise TimeoutError(f"{address} not healthy after {timeout}s ({last})")


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


def is_retryable(err: grpc.RpcError) -> bool:
    return err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)


def retry(fn: Callable[[], Any], what: str, timeout: float = 60.0, stop: Callable[[], bool] | None = None) -> Any:
    """Call fn until it succeeds, retrying transient gRPC errors with capped exponential backoff."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return fn()
        except grpc.RpcError as err:
            if not is_retryable(err) or time.monotonic() + delay > deadline or (stop and stop()):
                raise
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
