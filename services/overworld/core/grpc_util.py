"""gRPC plumbing shared by every service: servers with health checking, channels, errors, and the
one retry policy every client uses to ride through a service's restart."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter

from overworld.core.security import authz, tls

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
    # gRPC's own reconnect backoff grows to 120 s: a channel to a service that restarted would stay in
    # TRANSIENT_FAILURE long after the service is back. Reconnect as fast as the clients retry.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
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


class Refused(Exception):
    """Raised anywhere below an RPC handler: the call ends with this status code and message instead of
    a result (`answered`, which every server built by `serve` puts around every handler). A service
    refuses bad input or a call it cannot serve now by raising it, never by aborting inline."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _answered_stream(responses: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    try:
        yield from responses
    except Refused as err:
        context.abort(err.code, str(err))


def answered(behaviour: Callable[[Any, grpc.ServicerContext], Any], response_streaming: bool
             ) -> Callable[[Any, grpc.ServicerContext], Any]:
    """`behaviour` (a handler) with each Refused it raises, before its reply or while streaming its
    responses, turned into its status (context.abort)."""
    def handler(request: Any, context: grpc.ServicerContext, /) -> Any:
        try:
            result = behaviour(request, context)
        except Refused as err:
            context.abort(err.code, str(err))
        return _answered_stream(result, context) if response_streaming else result
    return handler


class RequestValidation(grpc.ServerInterceptor):
    """Every handler `answered` (a Refused becomes its status); bytes that do not parse as the method's
    request are answered INVALID_ARGUMENT naming the method and the parser's complaint. Left to gRPC they
    get INTERNAL "Exception deserializing request!", and that path leaks about 19 KB of the server's
    memory per call (grpcio 1.85; tests/fuzz found it)."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return handler
        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        behaviour = getattr(handler, kind)
        if handler.request_deserializer is None:  # a handler that takes the raw bytes parses them itself
            return handler._replace(**{kind: answered(behaviour, handler.response_streaming)})
        parse, method = handler.request_deserializer, details.method

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as err:  # noqa: BLE001 - any parser's complaint becomes the caller's error
                return _Malformed(err)

        def reject(context: grpc.ServicerContext, request: _Malformed) -> NoReturn:
            # context.abort, not Refused: a streamed request may be read on a thread of the handler's own
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid message "
                          f"({str(request.error)[:200] or type(request.error).__name__})")
            raise AssertionError("unreachable")  # context.abort raises

        if handler.request_streaming:
            # positional-only (grpc passes both so): the two variants differ only in a parameter's name
            def checked(requests: Any, context: grpc.ServicerContext, /) -> Any:
                def parsed() -> Any:
                    for request in requests:
                        if isinstance(request, _Malformed):
                            reject(context, request)
                        yield request
                return behaviour(parsed(), context)
        else:
            def checked(request: Any, context: grpc.ServicerContext, /) -> Any:
                if isinstance(request, _Malformed):
                    reject(context, request)
                return behaviour(request, context)
        return handler._replace(request_deserializer=tolerant,
                                **{kind: answered(checked, handler.response_streaming)})


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

    With this process's TLS credentials (core/security/tls.py) the port is mutual TLS and every call is checked
    against core/security/authz.py; without, plaintext. $OVERWORLD_HEALTH_PORT adds a plaintext port serving
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


def add_overriding(add_generated: Callable[[Any, Any], None], servicer: Any, server: Any, name: str,
                   overrides: dict[str, Any]) -> None:
    """Register `servicer` as the generated add_XServicer_to_server does, with some methods' handlers
    replaced (`overrides`, method name -> grpc handler): e.g. handlers that send pre-encoded bytes
    instead of messages the generated serializer would encode again for every caller."""
    captured: dict[str, Any] = {}

    class _Capture:
        def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
            pass

        def add_registered_method_handlers(self, _name: str, handlers: dict[str, Any]) -> None:
            captured.update(handlers)

    add_generated(servicer, _Capture())
    captured.update(overrides)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, captured),))
    server.add_registered_method_handlers(name, captured)


def channel(address: str, peer: str | None = None) -> grpc.Channel:
    """A channel to `address` with this process's credentials (mutual TLS), or plaintext without. With
    mutual TLS the server must present the certificate of `peer`, the identity the caller means to reach
    ("model-registry", ...; core/security/authz.py SERVING), or the calls fail with peers.WrongPeer."""
    files = tls.credentials()
    if files is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if peer not in authz.SERVING:
        raise ValueError(f"a mutual TLS channel to {address} needs the identity it means to reach, one of "
                         f"{', '.join(authz.SERVING)}; got {peer!r}")
    return tls.ReloadingChannel(address, files, CHANNEL_OPTIONS, peer)


def health_status(ch: grpc.Channel, service: str = "", timeout: float = 1.0, wait_for_ready: bool = False) -> int:
    """One health check on `ch` (the standard grpc.health.v1 service; "" asks about the server as a
    whole): its status, a `health_pb2.HealthCheckResponse.ServingStatus`. Raises grpc.RpcError."""
    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                                                 wait_for_ready=wait_for_ready)
    return int(reply.status)


def serving(ch: grpc.Channel, service: str = "", timeout: float = 1.0) -> bool:
    """One health check on `ch`: SERVING or not (not yet listening, starting, failed)."""
    try:
        return health_status(ch, service, timeout) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_healthy(address: str, timeout: float = 30.0, service: str = "", peer: str | None = None) -> None:
    """Block until the server at `address` (the identity `peer`, with mutual TLS) reports SERVING, or raise
    TimeoutError."""
    deadline = time.monotonic() + timeout
    with channel(address, peer) as ch:
        while time.monotonic() < deadline:
            if serving(ch, service, timeout=2.0):
                return
            time.sleep(0.1)
    raise TimeoutError(f"{address} not healthy after {timeout}s")


log = logging.getLogger("overworld.grpc")
T = TypeVar("T")

# A service restarting or handing over (a deleted pod, a preemption) costs its callers retried attempts;
# a call fails only when what it was for is lost: its retries gave up (the call's timeout), a lease
# lapsed, fragments were given up.
CALL_RETRIES = Counter(
    "overworld_client_call_retries_total",
    "Attempts of a call to another service that failed and were made again: by a retried call, or by a "
    "caller that tries again itself (a heartbeat's next period, a fragment stream opened again, the weights "
    "watch reconnecting)", ["call"])
CALLS_FAILED = Counter(
    "overworld_client_calls_failed_total",
    "Calls to another service whose failure reached the caller: a retried call that gave up, a lease that "
    "lapsed for want of a heartbeat, fragments given up at shutdown, a version that could not be fetched", ["call"])


def attempt_again(call: str) -> None:
    """Count an attempt that failed and is made again (`call`: "service.Method")."""
    CALL_RETRIES.labels(call).inc()


def call_failed(call: str) -> None:
    """Count a failed call the caller saw (`call`: "service.Method")."""
    CALLS_FAILED.labels(call).inc()


RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})


def is_retryable(err: grpc.RpcError) -> bool:
    return err.code() in RETRYABLE


class Backoff:
    """Capped exponential backoff: 0.05 s, 0.1 s, ... up to `cap` (2 s: a restarted service is found
    again within 2 s of coming back). `reset()` after a success."""

    def __init__(self, initial: float = 0.05, cap: float = 2.0) -> None:
        self.initial, self.cap = initial, cap
        self.delay = initial

    def next(self) -> float:
        """The delay to wait now; the next one doubles."""
        delay = self.delay
        self.delay = min(self.delay * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.delay = self.initial

    def wait(self, stop: threading.Event | None = None) -> bool:
        """Sleep the next delay (cut short by `stop`); True if stop was set."""
        delay = self.next()
        if stop is None:
            time.sleep(delay)
            return False
        return stop.wait(delay)


@dataclass(frozen=True)
class Retry:
    """How every client call rides through a restart of the service it calls: transient errors
    (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED) are retried with capped exponential
    backoff until `timeout` seconds have passed since the call began; each attempt gets the time
    left (at most `attempt` seconds), so no call takes longer than `timeout`. Other errors are
    raised at once. (gRPC's built-in retry policy stops after 5 attempts, a few seconds: not enough
    to wait out a service's restart, so Overworld retries here, in one place: the clients'
    `timeout=`, core/client.py.)"""

    timeout: float = 60.0
    attempt: float | None = None  # per-attempt timeout (None: the time left)
    initial_backoff: float = 0.05
    max_backoff: float = 2.0

    def run(self, fn: Callable[[float], T], what: str = "call", stop: Callable[[], bool] | None = None) -> T:
        """fn(left) until it succeeds; `left` is the attempt's deadline in seconds."""
        started = time.monotonic()
        end = started + self.timeout
        backoff = Backoff(self.initial_backoff, self.max_backoff)
        failures = 0
        while True:
            left = end - time.monotonic()
            try:
                result = fn(max(0.001, min(left, self.attempt) if self.attempt else left))
                if failures:
                    log.info("%s succeeded after %d failed attempts (%.1fs)", what, failures,
                             time.monotonic() - started)
                return result
            except grpc.RpcError as err:
                delay = backoff.next()
                if not is_retryable(err) or time.monotonic() + delay >= end or (stop and stop()):
                    call_failed(what)
                    raise
                failures += 1
                attempt_again(what)
                if failures == 1:
                    log.warning("%s: %s; retrying for up to %.0fs", what, err.code().name, self.timeout)
            time.sleep(delay)

    def unary(self, method: Callable[..., T], request: Any, what: str) -> T:
        """A unary stub call, retried: `Retry(30).unary(stub.GetStats, GetStatsRequest(), "GetStats")`."""
        return self.run(lambda timeout: method(request, timeout=timeout), what)
