"""The worker's side of the weights relay (docs/model_registry.md, "Relay").

The registry announces a new version with a source for each of its stripes (itself, or another
worker) and the hash of every chunk. `fetch_relayed` fetches every stripe at once, each from its
source over the weights stream (`stream/protocol.py`), into a `RelayedVersion`: one buffer for the whole
version, reused from one version to the next. Each chunk is checked against its hash as it arrives;
only then may this worker's relay (`serve_relayed`) pass it on, so a bad relay is caught at its hop
and its children never see what it changed. A source that breaks, stalls (nothing at all, or
keep-alives but no data) or sends a chunk that does not match costs a re-attach: the stripe goes on
from the registry at that chunk, and the source is reported to the registry (a liar or a stalled
relay is left out of the next plans). Once every chunk is in, the version is verified: the worker
may swap it in.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable

import grpc
from prometheus_client import Counter

from overworld.core.grpc_util import Backoff
from overworld.core.security import authz
from overworld.core.wire import safetensors_format
from overworld.model_registry import chunks
from overworld.model_registry.client import FetchBroken
from overworld.model_registry.relay_plan import REGISTRY, stripe_bounds
from overworld.model_registry.stream.protocol import (
    DATA,
    END,
    Altered,
    FrameWriter,
    Stalled,
    StreamError,
    open_stream,
)
from overworld.model_registry.stream.server import WeightsStreamServer
from overworld.v1 import model_registry_pb2 as pb

log = logging.getLogger("overworld.model_registry.worker.relay")

RELAY_BYTES_SERVED = Counter("overworld_relay_bytes_served_total", "Weight bytes this worker relayed to others")
RELAY_BYTES_RECEIVED = Counter("overworld_relay_bytes_received_total",
                               "Weight bytes received by relay, by where they came from", ["source"])
RELAY_BAD_CHUNKS = Counter("overworld_relay_bad_chunks_total",
                           "Chunks that did not match the hash the registry announced (fetched again from it)")
RELAY_REATTACHES = Counter("overworld_relay_reattaches_total",
                           "Stripes that went on from the registry after their relay failed", ["reason"])

# A source that sends nothing at all for this long is given up (a stopped or cut-off pod); it should
# exceed the time a chunk takes on the slowest link.
STALL_SECONDS = max(1.0, float(os.environ.get("OVERWORLD_RELAY_STALL_SECONDS", "10")))
# A relay waiting on its own source sends a keep-alive this often: its children hear that it lives and
# do not all give it up for the registry at once (only a relay that is itself silent is given up).
KEEPALIVE_SECONDS = STALL_SECONDS / 3
# ...but keep-alives are not data: a source that sends no chunk for twice the stall time is given up
# too. Its own stalled source is given up after STALL_SECONDS, so an honest relay's data resumes
# before then; one that only says it lives holds its children no longer.
DATA_STALL_SECONDS = 2 * STALL_SECONDS
WAIT_FOR_VERSION_SECONDS = 10.0  # a relay asked for a version it has not begun to receive waits this long
MAX_STRIPES = 64
RELAY_CONNECT_TRIES = 3  # a relay that answers nothing this many times in a row is given up
MIN_CHUNK, MAX_CHUNK = 64 << 10, 64 << 20  # what an announcement's chunk_bytes may be
RECEIVING, VERIFIED, FAILED = "receiving", "verified", "failed"
# The registry's answers that end a fetch (the version is gone or cannot be had): the others are retried.
REGISTRY_FINAL = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.UNAUTHENTICATED)


class RelayFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class BufferPool:
    """Version buffers handed back once nothing reads them: the next version of the same size is
    received into one (memory touched for the first time costs a page fault per 4 KB)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def get(self, size: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) == size:
                    return self._free.pop(i)
        return bytearray(size)

    def put(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)


class RelayedVersion:
    """One version as a worker receives it: one buffer, filled chunk by chunk (stripes at once, so out
    of order), each chunk readable once it matched its hash.

    The buffer goes back to the pool when the last hold is released: the fetch's (then the shelf's,
    while this worker relays it), the worker's (from take() until it takes a newer version: its tensors
    are views into the buffer), and each child's serve."""

    def __init__(self, info: pb.VersionInfo, chunk: int, precision: str, hashes: bytes, pool: BufferPool) -> None:
        self.info, self.chunk, self.precision = info, chunk, precision
        self.version, self.size = info.version, info.size_bytes
        self.count = -(-self.size // chunk)
        if len(hashes) != self.count * chunks.HASH_BYTES:
            raise ValueError(f"{len(hashes)} bytes of chunk hashes for {self.count} chunks")
        self.hashes = hashes
        self._pool = pool
        self._buffer: bytearray | None = pool.get(self.size)
        self.view = memoryview(self._buffer)[:self.size]
        self.verified = bytearray(self.count)
        self.state = RECEIVING
        self.error: RelayFailed | None = None
        self.cond = threading.Condition()
        self._holds = 1  # the fetch's

    def expected(self, index: int) -> tuple[int, int]:
        """Offset and length of chunk `index`."""
        start = index * self.chunk
        return start, min(self.chunk, self.size - start)

    def slot(self, index: int) -> memoryview:
        start, length = self.expected(index)
        return self.view[start:start + length]

    def matches(self, index: int) -> bool:
        h = chunks.HASH_BYTES
        return chunks.digest(self.slot(index)) == self.hashes[index * h:(index + 1) * h]

    def mark(self, index: int) -> None:
        """Chunk `index` is in and matched its hash: it may be passed on."""
        with self.cond:
            self.verified[index] = 1
            self.cond.notify_all()

    def wait(self, index: int, is_active: Callable[[], bool], timeout: float) -> memoryview | None:
        """Chunk `index`, waiting at most `timeout` seconds for it to be verified (None then)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                if self.verified[index]:
                    return self.slot(index)
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

    def complete(self) -> bool:
        return all(self.verified)

    def pieces(self) -> list[tuple[int, memoryview]]:
        """What `weights.from_pieces` reads: the whole version, one piece (every tensor a view)."""
        return [(0, self.view)]

    def hold(self) -> None:
        with self.cond:
            if self._buffer is None:
                raise RelayFailed(grpc.StatusCode.NOT_FOUND, f"version {self.version} was let go")
            self._holds += 1

    def release(self) -> None:
        with self.cond:
            self._holds -= 1
            if self._holds or self._buffer is None:
                return
            buf, self._buffer = self._buffer, None
        self._pool.put(buf)


class RelayShelf:
    """The versions this worker can relay (the one it is receiving and the newest it verified), and the
    pool their buffers come from."""

    def __init__(self) -> None:
        self._held: dict[int, RelayedVersion] = {}
        self._cond = threading.Condition()
        self.pool = BufferPool()

    def begin(self, info: pb.VersionInfo, chunk: int, precision: str, hashes: bytes) -> RelayedVersion:
        held = RelayedVersion(info, chunk, precision, hashes, self.pool)
        with self._cond:
            old = self._held.get(info.version)
            if old is not None and old.state == RECEIVING:
                old.finish(RelayFailed(grpc.StatusCode.ABORTED, f"version {info.version} is being received again"))
            self._held[info.version] = held
            self._cond.notify_all()
        return held

    def get(self, version: int, wait: float, is_active: Callable[[], bool]) -> RelayedVersion | None:
        """The version, held for the caller (who releases it), waiting up to `wait` seconds for this worker
        to begin receiving it; None at once for one older than what it holds (it will not come)."""
        deadline = time.monotonic() + wait
        with self._cond:
            while (held := self._held.get(version)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or not is_active() or version < max(self._held, default=0):
                    return None
                self._cond.wait(min(left, 1.0))
            held.hold()
            return held

    def settle(self, held: RelayedVersion, keep: bool = True) -> None:
        """After a fetch: keep `held` if verified (and `keep`: this worker relays), and nothing else; drop
        it if it failed (or not `keep`). The fetch's hold becomes the shelf's, or is released."""
        dropped = []
        with self._cond:
            if held.state != VERIFIED or not keep:
                if self._held.get(held.version) is held:
                    del self._held[held.version]
                dropped.append(held)
            else:
                for version in [v for v in self._held if v != held.version]:
                    dropped.append(self._held.pop(version))  # older ones, and newer ones a reset registry took back
        for version_held in dropped:
            version_held.release()

    def versions(self) -> list[int]:
        with self._cond:
            return sorted(self._held)


# -- serving -----------------------------------------------------------------------------------------

def check_range(request: pb.FetchRequest, chunk: int, size: int, version: int) -> tuple[int, int]:
    """The chunk indexes [first, last) a relay or registry stream request asks for; StreamError when the
    request is not whole chunks of this version."""
    end = request.offset + request.limit if request.limit else size
    if request.offset % chunk or request.offset > size or end > size or (end % chunk and end != size):
        raise StreamError(grpc.StatusCode.OUT_OF_RANGE, f"bytes {request.offset}..{end} of version {version} "
                          f"({size} bytes) are not whole chunks of {chunk} bytes")
    return request.offset // chunk, -(-end // chunk)


def serve_relayed(shelf: RelayShelf, request: pb.FetchRequest, writer: FrameWriter, is_active: Callable[[], bool]
                  ) -> None:
    """A child's stream: the chunks of a version this worker holds or is receiving, each as soon as it
    is verified here, keep-alives while it waits for them. Validates the request as the registry does."""
    if request.version == 0 or request.tag:
        raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, "a relay serves a version by number (version > 0, no tag)")
    deadline = time.monotonic() + WAIT_FOR_VERSION_SECONDS
    while (held := shelf.get(request.version, min(KEEPALIVE_SECONDS, deadline - time.monotonic()), is_active)) is None:
        if time.monotonic() >= deadline or request.version < max(shelf.versions(), default=0) or not is_active():
            break
        writer.keepalive()  # its announcement may come a little after the child's
    if held is None:
        raise StreamError(grpc.StatusCode.NOT_FOUND, f"this worker does not hold version {request.version} (it holds "
                          f"{shelf.versions()}): fetch it from the registry")
    try:
        try:
            precision = safetensors_format.half_precision(request.precision) or ""
        except ValueError as err:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, f"FetchRequest.precision: {err}") from None
        if precision != held.precision:
            raise StreamError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"this worker holds version {held.version} as {held.precision or 'stored'}, not "
                              f"{request.precision or 'stored'}")
        if request.chunk_size != held.chunk:
            raise StreamError(grpc.StatusCode.FAILED_PRECONDITION, f"this worker relays version {held.version} in "
                              f"chunks of {held.chunk} bytes, not {request.chunk_size}")
        first, last = check_range(request, held.chunk, held.size, held.version)
        for index in range(first, last):
            while (chunk := held.wait(index, is_active, KEEPALIVE_SECONDS)) is None:
                writer.keepalive()  # waiting on this worker's own source: say it lives
            writer.data(index, chunk)
            RELAY_BYTES_SERVED.inc(len(chunk))
    except RelayFailed as err:
        raise StreamError(err.code, f"relaying version {held.version}: {err}") from None
    finally:
        held.release()


def serve_relay(shelf: RelayShelf, host: str = "127.0.0.1", port: int = 0) -> WeightsStreamServer:
    """This worker's relay: its shelf on a weights-stream port, for the rollout-worker identity only."""
    return WeightsStreamServer(authz.WEIGHTS_FROM_RELAY,
                               lambda request, writer, active: serve_relayed(shelf, request, writer, active),
                               host, port)


# -- fetching ----------------------------------------------------------------------------------------

class _BadSource(Exception):
    """A source sent what does not fit the version (a chunk not asked for, the wrong size, an early end)."""


class _Lied(Exception):
    """A source sent a chunk that does not match its hash."""


def fetch_relayed(held: RelayedVersion, sources: list[str], registry: str, stop: Callable[[], bool],
                  timeout: float, faults: list[tuple[str, str]], depths: list[int] | None = None) -> None:
    """Fill `held`, stripe i from sources[i] ("" is the registry's weights stream at `registry`), every
    chunk checked against its hash. Marks `held` verified, or failed and raises FetchBroken: a source
    that fails hands its stripe to the registry, so only the registry's own answer (the version is gone)
    or the fetch's deadline ends a fetch without the version. Relays that lied or stalled are appended
    to `faults` as (address, "lied" | "stalled"). One stripe that cannot finish stops the others.
    `depths`: each source's depth in its stripe's tree (the announcement's; 1 each when absent): a relay
    of depth d is given d data stall times, one more than it gives its own source."""
    deadline = time.monotonic() + timeout
    depths = depths if depths and len(depths) == len(sources) else [1] * len(sources)
    errors: list[BaseException] = []
    failed = threading.Event()
    stripes = [(i, start, end) for i, (start, end) in enumerate(stripe_bounds(held.size, held.chunk, len(sources)))
               if end > start]

    def give_up() -> bool:
        return stop() or failed.is_set()

    def run(stripe: int, start: int, end: int) -> None:
        try:
            _fetch_stripe(held, start, end, sources[stripe], registry, give_up, deadline, faults, depths[stripe])
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
        if not errors and not held.complete():
            errors.append(FetchBroken(f"version {held.version}: chunks missing after every stripe ended"))
    except BaseException as err:  # (a thread that cannot start, say): the children must not wait on it
        failed.set()
        held.finish(RelayFailed(grpc.StatusCode.ABORTED, f"fetching version {held.version} stopped: {err!r}"))
        raise
    if errors:
        error = errors[0]
        held.finish(RelayFailed(grpc.StatusCode.ABORTED, str(error)))
        if isinstance(error, FetchBroken):
            raise error
        raise FetchBroken(f"fetching version {held.version} by relay failed: {error!r}") from error
    held.finish()


def _fetch_stripe(held: RelayedVersion, start: int, end: int, source: str, registry: str,
                  stop: Callable[[], bool], deadline: float, faults: list[tuple[str, str]], depth: int = 1) -> None:
    """Chunks [start, end) of `held` from `source` (at `depth` in its stripe's tree); from the registry once
    that fails."""
    index, last = start // held.chunk, -(-end // held.chunk)
    backoff = Backoff(0.1)
    unanswered = 0  # attempts in a row on which a relay answered nothing at all

    def give_up(reason: str, why: object) -> None:
        nonlocal source
        RELAY_REATTACHES.labels(reason).inc()
        if reason in ("stalled", "bad"):
            faults.append((source, "lied" if reason == "bad" else "stalled"))
        log.warning("relay %s %s on version %d (%s); fetching bytes %d..%d from the registry", source,
                    {"bad": "lied", "stalled": "stalled", "broken": "failed"}[reason], held.version, why,
                    index * held.chunk, end)
        source = REGISTRY

    def into(got: int, length: int) -> memoryview:
        """Where a DATA frame goes: the chunk asked for next, nothing else."""
        if got != index or length != held.expected(index)[1]:
            raise _BadSource(f"sent chunk {got} of {length} bytes, expected chunk {index} of {held.expected(index)[1]}")
        return held.slot(index)

    while index < last:
        if stop():
            raise FetchBroken("stopped")
        if time.monotonic() > deadline:
            raise FetchBroken(f"version {held.version} not received within the fetch's deadline")
        from_relay = source != REGISTRY
        request = pb.FetchRequest(version=held.version, offset=index * held.chunk, limit=end - index * held.chunk,
                                  chunk_size=held.chunk, precision=held.precision)

        answered = False
        try:
            # a relay waiting on its own (silent) source keeps this stripe waiting too, until it gives that
            # source up after its own data stall time: so one more stall time for each level above it
            data_stall = DATA_STALL_SECONDS * max(1, depth) if from_relay else DATA_STALL_SECONDS
            stream = open_stream(source if from_relay else registry, request, STALL_SECONDS, data_stall, stop,
                                 "rollout-worker" if from_relay else "model-registry", deadline=deadline)
            answered = True
            try:
                while True:
                    frame = stream.next(into)
                    if frame.kind == DATA:
                        if not held.matches(index):
                            RELAY_BAD_CHUNKS.inc()
                            raise _Lied(f"chunk {index} does not match its hash")
                        held.mark(index)
                        RELAY_BYTES_RECEIVED.labels("relay" if from_relay else "registry").inc(frame.length)
                        index += 1
                        backoff.reset()
                        unanswered = 0
                    elif frame.kind == END:
                        if index < last:
                            raise _BadSource(f"ended the stream at chunk {index} of {last}")
                        break
            finally:
                stream.close()
        except (_Lied, _BadSource, ValueError) as err:
            if not from_relay:
                raise FetchBroken(f"the registry {err}") from None
            give_up("bad", err)
        except Stalled as err:
            if stop():
                raise FetchBroken("stopped") from None
            if from_relay:
                give_up("stalled", err)
            else:
                backoff.wait()
        except StreamError as err:
            if from_relay:
                # once it answered, whatever breaks its frames (a tag, a header, an ERROR frame) is the
                # relay's doing: reported; a refusal before that only sends the stripe to the registry
                give_up("bad" if answered else "broken", err)
            elif isinstance(err, Altered) or err.code not in REGISTRY_FINAL:
                backoff.wait()  # the registry's frame did not open here (the path, not the registry): again
            else:
                raise FetchBroken(f"the registry answered {err}") from None
        except (OSError, ssl.SSLError) as err:
            if stop():
                raise FetchBroken("stopped") from None
            if from_relay and not answered and unanswered < RELAY_CONNECT_TRIES - 1:
                unanswered += 1  # no connection yet (a busy relay, a neighbour to resolve): try it again
                backoff.wait()
            elif from_relay:
                give_up("broken", err)
            else:
                backoff.wait()
