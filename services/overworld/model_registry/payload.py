"""The bytes of one version as the WeightsChunk messages every Fetch sends: where the messages of a
payload end (tensor boundaries, so that a receiver views each tensor in the message it arrived in),
and `Payload`, which encodes them once, while a Publish streams in or from stored bytes, and lets any
number of Fetch streams wait for the messages that have not arrived yet."""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Callable

import grpc

from overworld.core.grpc_util import Refused
from overworld.core.wire import safetensors_format
from overworld.model_registry import chunks, wire
from overworld.v1 import model_registry_pb2 as pb

DEFAULT_CHUNK = 4 << 20  # messages group small tensors up to this size
LARGEST_MESSAGE = 64 << 20  # a tensor up to this size travels in one message (viewed there, not copied)
# A fetch with its own chunk size is cut into at most this many messages: chunk_size=1 would otherwise
# turn one request into a message per byte (hours of a registry thread for a large model).
MAX_FETCH_MESSAGES = 4096
ALIGN = 16  # tensor data starts at this alignment inside a message
RECEIVING, VERIFIED, FAILED = "receiving", "verified", "failed"


class PayloadFailed(Refused):
    """A payload that cannot be had (a failed or broken publish, a version no longer retained): a handler
    that meets it ends its call with this status (Refused)."""


def message_bounds(head: bytes | bytearray | memoryview, size: int, target: int, largest: int) -> list[int] | None:
    """Where the messages of a payload end. For safetensors, at tensor boundaries: small tensors are
    grouped up to `target` bytes, a larger one gets a message of its own (split only beyond
    `largest`), so that a receiver can view every tensor inside the message it received instead of
    copying it out. Otherwise every `target` bytes. None while `head` is too short to tell."""
    fixed = [*range(target, size, target), size] if size else []
    view = memoryview(head)
    if len(view) < 8:
        return None if len(view) < size else fixed
    n = int.from_bytes(view[:8], "little")
    if n > safetensors_format.MAX_HEADER_BYTES or 8 + n > size:
        return fixed
    if len(view) < 8 + n:
        return None
    try:
        header, data_start = safetensors_format.read_header(view[:8 + n])
        spans = sorted((data_start + int(m["data_offsets"][0]), data_start + int(m["data_offsets"][1]))
                       for k, m in header.items() if k != "__metadata__")
    except (ValueError, KeyError, TypeError, IndexError):
        return fixed
    bounds: list[int] = []
    start = 0  # of the message being filled; the header goes with the first tensors
    for begin, end in spans:
        if begin < start or end > size or end < begin:
            return fixed  # overlapping or out of range: not a layout to rely on
        if end - start <= target:
            continue
        if begin > start:  # close the group before this tensor
            bounds.append(begin)
            start = begin
            if end - start <= target:  # it opens the next group
                continue
        if end - start <= largest:  # the tensor alone
            bounds.append(end)
        else:  # larger than any message may be: pieces (the receiver copies this one)
            bounds.extend(range(start + largest, end, largest))
            bounds.append(end)
        start = end
    if size > start:
        bounds.append(size)
    return bounds


class Payload:
    """The bytes of one version as the encoded WeightsChunk messages every Fetch sends.

    Filled message by message while a Publish streams in (`extend`), or at once from stored bytes
    (`complete`). Readers wait on `cond` for messages that have not arrived yet.
    """

    _seq = 0
    _seq_lock = threading.Lock()

    def __init__(self, info: pb.VersionInfo, chunk_size: int = DEFAULT_CHUNK, largest: int = LARGEST_MESSAGE) -> None:
        with Payload._seq_lock:
            Payload._seq += 1
            self.seq = Payload._seq  # tells a re-published version from the failed attempt before it
        self.info = info
        self.size = info.size_bytes
        self.chunk_size = chunk_size
        self.largest = max(largest, chunk_size)
        self.bounds: list[int] | None = None if self.size else []  # message ends, once the header is in
        self.starts: list[int] = []
        self.messages: list[bytes] = []
        self.header_lens: list[int] = []
        self._pending: list[memoryview] = []  # received, not encoded yet
        self._pending_len = 0
        self.state = RECEIVING
        self.error: PayloadFailed | None = None
        self.cond = threading.Condition()
        self.variants: dict[str, Payload] = {}
        self._variant_lock = threading.Lock()
        self._hashes: dict[int, bytes] = {}  # chunk size -> the hash of each chunk (the weights stream's)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The next bytes of the payload, in order (any piece size). Encodes every message they
        complete, each with one copy of the bytes (no assembly buffer), and wakes the readers.
        Only the publishing thread calls this."""
        if len(data):
            self._pending.append(memoryview(data))
            self._pending_len += len(data)
        if self.bounds is None:
            n = int.from_bytes(self._prefix(8), "little") if self._pending_len >= 8 else 0
            head = self._prefix(8 + n if n <= safetensors_format.MAX_HEADER_BYTES else 8)
            bounds = message_bounds(head, self.size, self.chunk_size, self.largest)
            if bounds is None and self._pending_len < self.size:
                return  # the header is not complete yet
            with self.cond:
                self.bounds = bounds or [*range(self.chunk_size, self.size, self.chunk_size), self.size]
                self.cond.notify_all()
        messages, header_lens, starts = [], [], []
        index = len(self.messages)
        start = self.bounds[index - 1] if index else 0
        while index < len(self.bounds) and self.bounds[index] - start <= self._pending_len:
            n = self.bounds[index] - start
            pieces: list[bytes | memoryview] = [wire.chunk_header(start, n, ALIGN)]
            need = n
            while need:
                head = self._pending[0]
                if len(head) <= need:
                    pieces.append(self._pending.pop(0))
                    need -= len(head)
                else:
                    pieces.append(head[:need])
                    self._pending[0] = head[need:]
                    need = 0
            self._pending_len -= n
            messages.append(b"".join(pieces))
            header_lens.append(len(pieces[0]))
            starts.append(start)
            start = self.bounds[index]
            index += 1
        if messages:
            with self.cond:  # appended under the lock: a reader cannot miss the wake-up
                self.header_lens.extend(header_lens)
                self.starts.extend(starts)
                self.messages.extend(messages)
                self.cond.notify_all()

    def _prefix(self, n: int) -> bytes:
        """The first n bytes pending (fewer if fewer have arrived)."""
        out, need = [], n
        for view in self._pending:
            if need <= 0:
                break
            out.append(view[:need])
            need -= len(out[-1])
        return b"".join(out)

    def complete(self, data: bytes | bytearray | memoryview) -> Payload:
        self.feed(data)
        self.mark(VERIFIED)
        return self

    def data_views(self) -> list[memoryview]:
        """The bytes of a complete payload as views into its messages (no copy)."""
        return [memoryview(m)[h:] for m, h in zip(self.messages, self.header_lens, strict=True)]

    def mark(self, state: str, error: PayloadFailed | None = None) -> None:
        with self.cond:
            self.state, self.error = state, error
            self.cond.notify_all()

    def _raise_if_failed_or_gone(self, is_active: Callable[[], bool]) -> None:
        if self.state == FAILED:
            assert self.error is not None
            raise self.error
        if not is_active():
            raise PayloadFailed(grpc.StatusCode.CANCELLED, "the fetch was cancelled")

    def wait_chunk(self, index: int, is_active: Callable[[], bool]) -> bytes | None:
        """The encoded message `index`, waiting for it while the Publish is still streaming; None past
        the last one."""
        with self.cond:
            while True:
                if self.bounds is not None and index >= len(self.bounds):
                    return None
                if index < len(self.messages):
                    return self.messages[index]
                self._raise_if_failed_or_gone(is_active)
                self.cond.wait(1.0)

    def index_of(self, offset: int, is_active: Callable[[], bool]) -> int | None:
        """The index of the message that starts at `offset` (None if none does)."""
        if offset == 0:
            return 0
        with self.cond:
            while self.bounds is None:
                self._raise_if_failed_or_gone(is_active)
                self.cond.wait(1.0)
        i = bisect.bisect_left(self.bounds, offset)
        return i + 1 if i < len(self.bounds) and self.bounds[i] == offset else None

    def wait_verified(self, is_active: Callable[[], bool]) -> None:
        with self.cond:
            while self.state == RECEIVING:
                self._raise_if_failed_or_gone(is_active)
                self.cond.wait(1.0)
            self._raise_if_failed_or_gone(lambda: True)

    def raw(self, start: int, end: int) -> bytes:
        """data[start:end] of a complete payload (for fetches at an odd offset or chunk size)."""
        parts = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.messages) and self.starts[i] < end:
            base, head = self.starts[i], self.header_lens[i]
            stop = self.bounds[i] if self.bounds else base
            lo, hi = max(start, base) - base, min(end, stop) - base
            if hi > lo:
                parts.append(memoryview(self.messages[i])[head + lo:head + hi])
            i += 1
        return b"".join(parts)

    def data(self) -> bytes:
        return self.raw(0, self.size)

    def view(self, start: int, end: int) -> memoryview:
        """data[start:end] of a complete payload: a view into its message when one holds it (most chunks
        of the weights stream), else a copy."""
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        if i < len(self.messages) and self.bounds and end <= self.bounds[i]:
            base, head = self.starts[i], self.header_lens[i]
            return memoryview(self.messages[i])[head + start - base:head + end - base]
        return memoryview(self.raw(start, end))

    def chunk_hashes(self, chunk: int) -> bytes:
        """The hash of each `chunk`-byte chunk of a complete payload (chunks.py), computed once per size."""
        with self._variant_lock:
            found = self._hashes.get(chunk)
            if found is None:
                found = self._hashes[chunk] = chunks.chunk_hashes(self.size, chunk, self.view)
            return found

    def variant(self, precision: str, is_active: Callable[[], bool]) -> Payload:
        """This version with its floating tensors cast to `precision`: converted once, then cached."""
        self.wait_verified(is_active)
        with self._variant_lock:
            found = self.variants.get(precision)
            if found is None:
                try:
                    data = safetensors_format.convert(self.data(), precision)
                except ValueError as err:
                    raise PayloadFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"cannot send version {self.info.version} as {precision}: {err}") from None
                info = pb.VersionInfo()
                info.CopyFrom(self.info)
                info.sha256, info.size_bytes = hashlib.sha256(data).hexdigest(), len(data)
                info.dtype = safetensors_format.payload_dtype(data)
                found = self.variants[precision] = Payload(info, self.chunk_size, self.largest).complete(data)
            return found
