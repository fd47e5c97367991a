"""gRPC plumbing shared by every service: servers with health checking, channels, errors."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from overworld.core import authz, tls

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
    health_server: grpc.Server | None = None

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
        if self.health_server is not None:
            self.health_server.stop(0)


HEALTH_PORT_ENV = "OVERWORLD_HEALTH_PORT"


class _Malformed:
    def __init__(self, error: Exception) -> None:
        self.error = error


class RequestValidation(grpc.ServerInterceptor):
    """Bytes that do not parse as the method's request are answered INVALID_ARGUMENT naming the method
    and the parser's complaint. Left to gRPC they get INTERNAL "Exception deserializing request!", and
    that path leaks about 19 KB of the server's memory per call (grpcio 1.85; tests/fuzz found it)."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as err:  # noqa: BLE001 - any parser's complaint becomes the caller's error
                return _Malformed(err)

        def reject(context: grpc.ServicerContext, request: _Malformed) -> NoReturn:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"{method}: the request is not a valid message ({str(request.error)[:200] or type(request.error).__name__})")

        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        behaviour = getattr(handler, kind)
        if handler.request_streaming:
            def checked(requests: Any, context: grpc.ServicerContext) -> Any:
                def parsed() -> Any:
                    for request in requests:
                        if isinstance(request, _Malformed):
                            reject(context, request)
                        yield request
                return behaviour(parsed(), context)
        else:
            def checked(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    reject(context, request)
                return behaviour(request, context)
        return handler._replace(request_deserializer=tolerant, **{kind: checked})


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _health_only(servicer: health.HealthServicer, host: str, port: int) -> grpc.Server:
    """The health service alone, plaintext: kubelet's gRPC probe sends no client certificate."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(_address(host, port)) == 0:
        raise OSError(f"cannot bind the health port {host}:{port}")
    server.start()
    return server


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
    """Start a gRPC server with the given (add_XServicer_to_server, servicer, full_service_name) triples.

    With this process's TLS credentials (core/tls.py) the port is mutual TLS and every call is checked
    against core/authz.py; without, plaintext. $OVERWORLD_HEALTH_PORT adds a plaintext port serving
    only the health service (the chart's probes)."""
    options = list(SERVER_OPTIONS)
    if max_connection_age:
        options += [("grpc.max_connection_age_ms", int(max_connection_age * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(FRONT_MAX_CONNECTION_AGE_GRACE_S * 1000))]
    files = tls.credentials()
    # Authorization first: a caller who may not call a method learns nothing about its requests.
    interceptors = [*([authz.Authorizer(files.run())] if files else []), RequestValidation()]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options,
                         interceptors=interceptors)
    names = []
    for add, servicer, name in registrations:
        add(servicer, server)
        names.append(name)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if files:
        bound = server.add_secure_port(_address(host, port), files.server_credentials())
    else:
        bound = server.add_insecure_port(_address(host, port))
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    health_port = int(os.environ.get(HEALTH_PORT_ENV) or 0)
    health_server = _health_only(health_servicer, host, health_port) if health_port else None
    server.start()
    out = Server(server, bound, health_servicer, names, health_server)
    out.set_serving(True)
    logging.getLogger("overworld.grpc").info(
        "serving %s on %s:%d (%s)", ", ".join(names) or "health", host, bound,
        f"mutual TLS as {files.directory}" if files else "plaintext")
    return out


def channel(address: str) -> grpc.Channel:
    """A channel to `address` with this process's credentials (mutual TLS), or plaintext without."""
    files = tls.credentials()
    if files is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return tls.ReloadingChannel(address, files, CHANNEL_OPTIONS)


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
