"""The one shape of every service's client (`<service>/client.py`), modelled on Reverb's `Client`:
one object per service address, whose methods are the service's calls.

    with ReplayBufferClient("replay-buffer:50052") as buffer:
        buffer.set_model_version(7, timeout=60.0)
        print(buffer, buffer.stats(timeout=5.0).chunks)      # ReplayBufferClient('replay-buffer:50052') 12
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

import grpc

from overworld.core import grpc_util


class ServiceClient:
    """A client of one service at `address` (host:port).

    Construction: `XClient(address)` opens a channel with this process's credentials (`grpc_util.channel`:
    mutual TLS when the process has an identity, `tls.use` or $OVERWORLD_TLS_DIR; plaintext otherwise),
    on which the server must present the certificate of the client's service (a rollout worker's, say,
    is refused where the registry was meant: `core/security/peers.py` WrongPeer), and `close()` closes it.
    `XClient(address, channel=ch)` calls over a channel made otherwise (a port-forward's, one channel per
    client in a benchmark, a kubelet-like plaintext one in a test): it stays its maker's, and `close()`
    leaves it open. Either way the client is a context manager.

    Time: every method takes one keyword, `timeout=` (seconds): the most the whole call may take, its
    retries included. Whether a method retries is the method's, never a flag (its docstring says
    "Retried"): a call its caller waits on and cannot do without (a read, an idempotent write) retries
    transient errors (`grpc_util.RETRYABLE`: a service restarting) with backoff until `timeout` has passed
    (`grpc_util.Retry`); a call whose failure costs nothing or that its caller gets round on its own
    terms makes one attempt with `timeout` as its deadline: periodic calls (the next period is their
    retry), streams handed to the caller, Reserve (the reservations' loop retries it), GetStoreInfo
    (sampling stays in-band meanwhile), and `call`. `wait=` is never a deadline: it is a request
    field, how long the service may hold the call before it answers (Reserve: room; GetPushStatus: a
    push completing; Sample: chunks), and the method's default `timeout` covers it.

    The stub is private. `call(method, request, timeout=)` is the one way to reach a method with a
    request built by hand: for tests of a service's own behaviour (its refusals of malformed input,
    its answer to one attempt, request fields no method sets), benchmarks of the wire itself, and the
    client's own helper modules (reader.py); everything else uses the methods. No test or benchmark
    builds or reaches a stub (tests/test_client_shape.py).
    """

    def __init__(self, address: str, stub: Callable[[grpc.Channel], Any], peer: str, *,
                 channel: grpc.Channel | None = None) -> None:
        """`stub`: the service's generated stub class; `peer`: the identity its server must present (a
        subclass passes its own: ReplayBufferClient "replay-buffer", ...)."""
        self._address = address
        self._owns_channel = channel is None
        self._channel: grpc.Channel = grpc_util.channel(address, peer) if channel is None else channel
        self._stub = stub(self._channel)

    @property
    def address(self) -> str:
        """The service's address (host:port), as given."""
        return self._address

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._address!r})"

    def call(self, method: str, request: Any, *, timeout: float) -> Any:
        """One attempt of the service's `method` (its name in the .proto: "Insert", "GetStats") with a
        request built by the caller (an iterator of requests for a client-streaming method). Returns the
        reply, or for a server-streaming method the iterator of replies (cancel it with .cancel());
        raises grpc.RpcError. Not retried; see the class docstring for who may use it."""
        bound = getattr(self._stub, method, None) if method[:1].isupper() else None
        if bound is None:
            raise AttributeError(f"{type(self).__name__}: the service has no method {method!r}")
        return bound(request, timeout=timeout)

    def close(self) -> None:
        """Close the channel this client opened (a channel given to the constructor stays open)."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
