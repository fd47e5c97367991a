"""The worker's side of the weights relay (docs/model_registry.md, "Relay").

The registry announces a new version with a source for each of its stripes: itself, or another
worker. `fetch_relayed` fetches every stripe at once, each from its source, into a `RelayedVersion`;
meanwhile this worker's `FetchWeights` (`serve_relayed`) passes each message on, as soon as it has
arrived, to the workers the registry sent here. A source that breaks, stalls or sends what does
not fit costs a re-attach: the stripe goes on from the registry at the first message missing. Once
every stripe is in, the whole is checked against the sha256 the registry announced; only then may
the worker swap it in. What a relay passes on is not checked by the relay (its children check it
themselves), so a bad relay costs its subtree a fetch from the registry, never a wrong version.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import Counter

from overworld.core import safetensors_format
from overworld.core.grpc_util import Backoff, abort, channel, is_retryable
from overworld.model_registry import wire
from overworld.model_registry.client import FetchBroken, ModelRegistryClient
from overworld.model_registry.relay_plan import REGISTRY, stripe_bounds
from overworld.v1 import model_registry_pb2 as pb

log = logging.getLogger("overworld.model_registry.relay")

RELAY_BYTES_SERVED = Counter("overworld_relay_bytes_served_total", "Weight bytes this worker relayed to others")
RELAY_BYTES_RECEIVED = Counter("overworld_relay_bytes_received_total",
                               "Weight bytes received by relay, by where they came from", ["source"])
RELAY_REFETCHES = Counter("overworld_relay_refetches_total",
                          "Versions fetched again whole from the registry: the relayed bytes did not match its sha256")
RELAY_REATTACHES = Counter("overworld_relay_reattaches_total",
                           "Stripes that went on from the registry after their relay failed", ["reason"])

# A source that sends nothing for this long is given up (a stopped or cut-off pod); it should exceed
# the time a message of RELAY_CHUNK bytes takes on the slowest link.
STALL_SECONDS = max(1.0, float(os.environ.get("OVERWORLD_RELAY_STALL_SECONDS", "10")))
# A relay waiting on its own source sends an empty message this often: its children hear that it lives
# and do not all give it up for the registry at once (only a relay that is itself silent is given up).
KEEPALIVE_SECONDS = STALL_SECONDS / 3
WAIT_FOR_VERSION_SECONDS = 10.0  # a relay asked for a version it has not begun to receive waits this long
MAX_STRIPES = 64
RELAY_CONNECT_TRIES = 3  # a relay that answers nothing this many times in a row is given up
MIN_CHUNK, MAX_CHUNK = 64 << 10, 64 << 20  # what an announcement's chunk_bytes may be
_FETCH_WEIGHTS = "/overworld.v1.RolloutWorker/FetchWeights"
KEEPALIVE = pb.WeightsChunk().SerializeToString()  # no data: the receiver counts it as a sign of life
RECEIVING, VERIFIED, FAILED = "receiving", "verified", "failed"


class RelayMismatch(FetchBroken):
    """What arrived by relay does not match the sha256 the registry announced."""


class RelayFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RelayedVersion:
    """One version as a worker receives it: WeightsChunk messages of `chunk` bytes of data, filled
    stripe by stripe (so out of order), each kept as received to be passed on unchanged."""

    def __init__(self, info: pb.VersionInfo, chunk: int, precision: str) -> None:
        self.info, self.chunk, self.precision = info, chunk, precision
        self.version, self.size = info.version, info.size_bytes
        self.count = -(-self.size // chunk)
        self.messages: list[bytes | None] = [None] * self.count
        self.data: list[memoryview | None] = [None] * self.count
        self.state = RECEIVING
        self.error: RelayFailed | None = None
        self.cond = threading.Condition()

    def expected(self, index: int) -> tuple[int, int]:
        """Offset and length of message `index`'s data."""
        start = index * self.chunk
        return start, min(self.chunk, self.size - start)

    def put(self, index: int, message: bytes, data: memoryview) -> None:
        with self.cond:
            self.messages[index], self.data[index] = message, data
            self.cond.notify_all()

    def wait(self, index: int, is_active: Callable[[], bool], timeout: float) -> bytes | None:
        """Message `index`, waiting at most `timeout` seconds for it to arrive (None then)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                message = self.messages[index]
                if message is not None:
                    return message
                if self.state == FAILED:
                    assert self.error is not None
                    raise self.error
                if not is_active():
                    raise RelayFailed(grpc.StatusCode.CANCELLED, "the fetch was cancelled")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(1.0, left))

    def finish(self, error: RelayFailed | None = None) -> None:
        with self.cond:
            self.state, self.error = (FAILED, error) if error else (VERIFIED, None)
            self.cond.notify_all()

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for data in self.data:
            assert data is not None
            digest.update(data)
        return digest.hexdigest()

    def pieces(self) -> list[tuple[int, memoryview]]:
        """(offset, data) of each message: what `weights.from_pieces` reads."""
        return [(i * self.chunk, d) for i, d in enumerate(self.data) if d is not None]


class RelayShelf:
    """The versions this worker can relay: the one it is receiving and the newest it verified."""

    def __init__(self) -> None:
        self._held: dict[int, RelayedVersion] = {}
        self._cond = threading.Condition()

    def begin(self, info: pb.VersionInfo, chunk: int, precision: str) -> RelayedVersion:
        held = RelayedVersion(info, chunk, precision)
        with self._cond:
            old = self._held.get(info.version)
            if old is not None and old.state == RECEIVING:
                old.finish(RelayFailed(grpc.StatusCode.ABORTED, f"version {info.version} is being received again"))
            self._held[info.version] = held
            self._cond.notify_all()
        return held

    def get(self, version: int, wait: float, is_active: Callable[[], bool]) -> RelayedVersion | None:
        """The version, waiting up to `wait` seconds for this worker to begin receiving it; None at once
        for one older than what it holds (it skipped or dropped it: it will not come)."""
        deadline = time.monotonic() + wait
        with self._cond:
            while (held := self._held.get(version)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or not is_active() or version < max(self._held, default=0):
                    return None
                self._cond.wait(min(left, 1.0))
            return held

    def settle(self, held: RelayedVersion, keep: bool = True) -> None:
        """After a fetch: keep `held` if verified (and `keep`: this worker relays), and nothing else; drop
        it if it failed (or not `keep`)."""
        with self._cond:
            if held.state != VERIFIED or not keep:
                if self._held.get(held.version) is held:
                    del self._held[held.version]
                return
            for version in [v for v in self._held if v != held.version]:
                del self._held[version]  # older ones, and newer ones a reset registry took back

    def versions(self) -> list[int]:
        with self._cond:
            return sorted(self._held)


# -- serving -----------------------------------------------------------------------------------------

def serve_relayed(shelf: RelayShelf, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
    """FetchWeights: the messages of a version this worker holds or is receiving, from a message
    boundary, each sent as soon as it is here. Validates the request as the registry's Fetch does."""
    if request.version == 0 or request.tag:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a relay serves a version by number (version > 0, no tag)")
    held = shelf.get(request.version, WAIT_FOR_VERSION_SECONDS, context.is_active)
    if held is None:
        abort(context, grpc.StatusCode.NOT_FOUND,
              f"this worker does not hold version {request.version} (it holds {shelf.versions()}): fetch it "
              "from the registry")
    try:
        precision = safetensors_format.half_precision(request.precision) or ""
    except ValueError as err:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"FetchRequest.precision: {err}")
    if precision != held.precision:
        abort(context, grpc.StatusCode.FAILED_PRECONDITION,
              f"this worker holds version {held.version} as {held.precision or 'stored'}, not "
              f"{request.precision or 'stored'}")
    if request.chunk_size != held.chunk:
        abort(context, grpc.StatusCode.FAILED_PRECONDITION,
              f"this worker relays version {held.version} in messages of {held.chunk} bytes, not {request.chunk_size}")
    end = request.offset + request.limit if request.limit else held.size
    if request.offset % held.chunk or request.offset > held.size or end > held.size or (
            end % held.chunk and end != held.size):
        abort(context, grpc.StatusCode.OUT_OF_RANGE,
              f"bytes {request.offset}..{end} of version {held.version} ({held.size} bytes) are not whole "
              f"messages of {held.chunk} bytes")
    yield wire.encode_info_chunk(held.info, request.offset)
    try:
        for index in range(request.offset // held.chunk, -(-end // held.chunk)):
            while (message := held.wait(index, context.is_active, KEEPALIVE_SECONDS)) is None:
                yield KEEPALIVE  # waiting on this worker's own source: say it lives
            RELAY_BYTES_SERVED.inc(held.expected(index)[1])
            yield message
    except RelayFailed as err:
        abort(context, err.code, f"relaying version {held.version}: {err}")


# -- fetching ----------------------------------------------------------------------------------------

class RelayClient:
    """A worker's FetchWeights, as the registry's Fetch: a stream of decoded chunks (views into the
    received messages)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = channel(address)
        self._fetch = self._channel.unary_stream(_FETCH_WEIGHTS, request_serializer=pb.FetchRequest.SerializeToString,
                                                 response_deserializer=wire.decode_chunk, _registered_method=True)  # type: ignore[call-arg]  # grpc's own keyword; types-grpcio lacks it

    def fetch_chunks(self, request: pb.FetchRequest, timeout: float) -> Any:
        return self._fetch(request, timeout=timeout)

    def close(self) -> None:
        self._channel.close()


def fetch_relayed(held: RelayedVersion, sources: list[str], registry: ModelRegistryClient,
                  stop: Callable[[], bool], timeout: float, stall: float = STALL_SECONDS) -> None:
    """Fill `held` (fetched in its precision, in messages of its chunk size), stripe i from sources[i],
    and check the whole against held.info.sha256. Marks `held` verified, or failed and raises
    FetchBroken (RelayMismatch: it did not match): a source that fails hands its stripe to the
    registry, so only the registry's own answer (NOT_FOUND: the version is gone; UNAVAILABLE for
    `timeout`) or a sha256 mismatch ends a fetch without the version. One stripe that cannot finish
    stops the others."""
    deadline = time.monotonic() + timeout
    errors: list[BaseException] = []
    failed = threading.Event()
    stripes = [(i, start, end) for i, (start, end) in enumerate(stripe_bounds(held.size, held.chunk, len(sources)))
               if end > start]

    def give_up() -> bool:
        return stop() or failed.is_set()

    def run(stripe: int, start: int, end: int) -> None:
        try:
            _fetch_stripe(held, start, end, sources[stripe], registry, give_up, deadline, stall)
        except BaseException as err:  # handed to the caller
            errors.append(err)
            failed.set()

    threads = [threading.Thread(target=run, args=stripe, name=f"relay-stripe-{stripe[0]}", daemon=True)
               for stripe in stripes]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if not errors and held.sha256() != held.info.sha256:
            errors.append(RelayMismatch(f"version {held.version} from {sorted(set(sources))} does not match the "
                                        "sha256 the registry announced"))
    except BaseException as err:  # (a thread that cannot start, say): the children must not wait on it
        failed.set()
        held.finish(RelayFailed(grpc.StatusCode.ABORTED, f"fetching version {held.version} stopped: {err!r}"))
        raise
    if errors:
        error = errors[0]
        code = error.code() if isinstance(error, grpc.RpcError) else grpc.StatusCode.ABORTED
        held.finish(RelayFailed(code, str(error)))
        if isinstance(error, grpc.RpcError | FetchBroken):
            raise error
        raise FetchBroken(f"fetching version {held.version} by relay failed: {error!r}") from error
    held.finish()


def _fetch_stripe(held: RelayedVersion, start: int, end: int, source: str, registry: ModelRegistryClient,
                  stop: Callable[[], bool], deadline: float, stall: float) -> None:
    """Messages [start, end) of `held` from `source`; from the registry once that fails."""
    index, last = start // held.chunk, -(-end // held.chunk)
    backoff = Backoff(0.1)
    unanswered = 0  # attempts in a row on which a relay answered nothing at all
    while index < last:
        if stop():
            raise FetchBroken("stopped")
        left = deadline - time.monotonic()
        if left <= 0:
            raise FetchBroken(f"version {held.version} not received within the fetch's deadline")
        relay = RelayClient(source) if source != REGISTRY else None
        request = pb.FetchRequest(version=held.version, offset=index * held.chunk, limit=end - index * held.chunk,
                                  chunk_size=held.chunk, precision=held.precision)
        call = (relay or registry).fetch_chunks(request, timeout=left)
        progress = [time.monotonic()]
        watchdog = _Watchdog(call, progress, stall, stop)
        answered = False
        try:
            for chunk in call:
                progress[0] = time.monotonic()
                answered = True
                if chunk.info is not None and (chunk.info.version != held.version
                                               or chunk.info.size_bytes != held.size):
                    raise _BadSource(f"sent version {chunk.info.version} of {chunk.info.size_bytes} bytes")
                if not len(chunk.data):
                    continue
                offset, size = held.expected(index)
                if index >= last or chunk.offset != offset or len(chunk.data) != size:
                    raise _BadSource(f"sent bytes {chunk.offset}+{len(chunk.data)}, expected {offset}+{size}")
                held.put(index, chunk.data.obj, chunk.data)
                RELAY_BYTES_RECEIVED.labels("registry" if relay is None else "relay").inc(size)
                index += 1
                backoff.reset()
                unanswered = 0
            if index < last:
                raise _BadSource(f"ended the stream at message {index} of {last}")
        except (grpc.RpcError, _BadSource) as err:
            if stop():
                raise FetchBroken("stopped") from None
            if (relay is not None and not answered and isinstance(err, grpc.RpcError)
                    and err.code() == grpc.StatusCode.UNAVAILABLE and unanswered < RELAY_CONNECT_TRIES - 1):
                unanswered += 1  # no connection yet (a busy relay, a neighbour to resolve): try it again
                backoff.wait()
                continue
            if relay is not None:  # re-attach: the rest of the stripe from the registry
                reason = "stalled" if watchdog.fired else "bad" if isinstance(err, _BadSource) else "broken"
                RELAY_REATTACHES.labels(reason).inc()
                log.warning("relay %s %s version %d (%s); fetching bytes %d..%d from the registry", source,
                            "stalled on" if watchdog.fired else "failed", held.version,
                            err if isinstance(err, _BadSource) else f"{err.code().name}: {err.details()}",
                            index * held.chunk, end)
                source = REGISTRY
                continue
            if isinstance(err, _BadSource):
                raise FetchBroken(f"the registry {err}") from None
            if not (is_retryable(err) or watchdog.fired):
                raise
            backoff.wait()
        finally:
            watchdog.cancel()
            if relay is not None:
                relay.close()


class _BadSource(Exception):
    """A source sent something that does not fit the version (it is then given up)."""


class _Watchdog:
    """Cancels a stream that made no progress for `stall` seconds."""

    def __init__(self, call: Any, progress: list[float], stall: float, stop: Callable[[], bool]) -> None:
        self.fired = False
        self._done = threading.Event()

        def watch() -> None:
            while not self._done.wait(min(1.0, stall / 4)):
                if stop() or time.monotonic() - progress[0] > stall:
                    self.fired = not stop()
                    call.cancel()
                    return

        threading.Thread(target=watch, name="relay-watchdog", daemon=True).start()

    def cancel(self) -> None:
        self._done.set()
