"""Who may call what: the one table of Overworld's authorization, and the server interceptor that
enforces it (the weights stream, model_registry/stream/protocol.py, checks the same table).

Every gRPC client presents a certificate of the run's CA (core/security/tls.py); its identity is the service
kind in that certificate (SAN URI ``spiffe://overworld/<run>/<identity>``, else the common name).
A call whose identity is not allowed the method gets PERMISSION_DENIED naming both. The table is
documented in docs/operations.md ("Security"); tests/security checks every cell over real sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc

_RM = "/overworld.v1.RolloutManager/"
_RB = "/overworld.v1.ReplayBuffer/"
_GAE = "/overworld.v1.Gae/"
_MR = "/overworld.v1.ModelRegistry/"
_TR = "/overworld.v1.Trainer/"
_RW = "/overworld.v1.RolloutWorker/"
_WS = "/overworld.v1.WeightsStream/"
HEALTH = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")

# The weights stream's endpoints (not gRPC: model_registry/stream/protocol.py), named as methods so that the
# table covers them: the registry's port, each rollout worker's relay port, and the registry's publish port.
WEIGHTS_FROM_REGISTRY = _WS + "Registry"
WEIGHTS_FROM_RELAY = _WS + "Relay"
WEIGHTS_PUBLISH = _WS + "Publish"
STREAM_METHODS = (WEIGHTS_FROM_REGISTRY, WEIGHTS_FROM_RELAY, WEIGHTS_PUBLISH)

# Reading status: what the run-controller and `overworld status` / `overworld run` look at.
READ_STATUS = (_RM + "GetFleetStatus", _RM + "ListVideos", _RB + "GetStats", _MR + "ListVersions",
               _MR + "GetPushStatus", _TR + "GetStatus", _RW + "GetStatus")

# identity -> the methods it may call (besides the health service, open to every identity).
ALLOWED: dict[str, tuple[str, ...]] = {
    "rollout-worker": (_RM + "GetRunConfig", _RM + "Register", _RM + "Heartbeat", _RM + "Deregister",
                       _RM + "ReportEpisodes", _RM + "UploadVideo",
                       _RB + "Insert", _RB + "Reserve",
                       _MR + "Watch", _MR + "WatchAnnouncements", _MR + "Fetch", _MR + "AckVersion",
                       # the weights stream: a version's chunks from the registry, and passed on from one
                       # worker to another (the relay)
                       WEIGHTS_FROM_REGISTRY, WEIGHTS_FROM_RELAY),
    # the run's spaces to check fragments by; the leases that room is reserved under
    "replay-buffer": (_RM + "GetRunConfig", _RM + "GetSpaces", _RM + "ListLeases"),
    # The trainer driver and its Ray Train workers (the same certificate on every Ray node).
    "trainer": (_RM + "GetRunConfig", _RM + "GetFleetStatus", _RM + "RequestVideo",
                _RB + "Sample", _RB + "SetModelVersion", _RB + "GetStoreInfo", _RB + "GetStats",
                _GAE + "Estimate",
                _MR + "Publish", _MR + "GetPublishEndpoint", WEIGHTS_PUBLISH,
                _MR + "SetTag", _MR + "ListVersions", _MR + "GetPushStatus",
                _TR + "ReportProgress", _TR + "GetStatus",
                # a Ray worker pod's preStop: its node is going
                _TR + "RequestStop"),
    "gae": (),
    "model-registry": (),
    "rollout-manager": (),
    "run-controller": READ_STATUS,
    # A person: `overworld status`, the `overworld run` launcher, scripts. Reads, and drains a worker.
    "operator": (*READ_STATUS, _RW + "Drain"),
}
IDENTITIES = tuple(ALLOWED)
# Identities that serve gRPC: only their certificates may be presented by a server (core/security/tls.py).
SERVING = ("rollout-manager", "rollout-worker", "replay-buffer", "gae", "model-registry", "trainer")


def allowed(identity: str, method: str) -> bool:
    return method in HEALTH or method in ALLOWED.get(identity, ())


def callers(method: str) -> list[str]:
    """The identities allowed to call `method` (the table read the other way)."""
    return [i for i in IDENTITIES if allowed(i, method)]


SPIFFE_PREFIX = "spiffe://overworld/"


def spiffe_id(run: str, identity: str) -> str:
    return f"{SPIFFE_PREFIX}{run}/{identity}"


def peer_identity(auth_context: Mapping[str, Iterable[bytes]]) -> tuple[str, str]:
    """(run, identity) of an authenticated peer; run is "" when the certificate names none (a CN-only
    certificate, as Helm's genSignedCert makes). ("", "") for an unauthenticated peer."""
    for uri in auth_context.get("peer_spiffe_id", ()):
        text = uri.decode(errors="replace")
        if text.startswith(SPIFFE_PREFIX):
            run, _, identity = text[len(SPIFFE_PREFIX):].rpartition("/")
            return run, identity
    for cn in auth_context.get("x509_common_name", ()):
        return "", cn.decode(errors="replace")
    return "", ""


def certificate_identity(cert: Mapping[str, Any]) -> tuple[str, str]:
    """(run, identity) of a peer from its certificate as Python's ssl decodes it (getpeercert()), read as
    peer_identity reads gRPC's auth context: the SPIFFE URI, else the common name."""
    context: dict[str, list[bytes]] = {"peer_spiffe_id": [], "x509_common_name": []}
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "URI":
            context["peer_spiffe_id"].append(str(value).encode())
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                context["x509_common_name"].append(str(value).encode())
    return peer_identity(context)


def refusal(own_run: str, run: str, identity: str, method: str) -> str | None:
    """Why a caller of (run, identity) may not call `method` of a server of `own_run`; None if it may."""
    if run and own_run and run != own_run:
        return f"{identity or 'caller'} of run {run!r} may not call {method} of run {own_run!r}"
    if not allowed(identity, method):
        return f"{identity or 'an unauthenticated caller'} may not call {method}"
    return None


class Authorizer(grpc.ServerInterceptor):
    """Checks every call against ALLOWED before the servicer sees it. `run` is the server's own run
    (from its certificate): a caller whose certificate names another run is refused too, so that
    runs whose certificates come from one shared issuer stay apart."""

    def __init__(self, run: str = "") -> None:
        self.run = run

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        behaviour = getattr(handler, kind)
        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            run, identity = peer_identity(context.auth_context())  # type: ignore[arg-type]  # types-grpcio: str -> bytes; grpc gives str -> list of bytes
            refused = refusal(self.run, run, identity, method)
            if refused:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
            return behaviour(request, context)

        # An abort raised here is answered like one raised by the servicer, streaming or not.
        return handler._replace(**{kind: checked})
