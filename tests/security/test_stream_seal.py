"""The weights stream's sealing, attacked on the wire: a man in the middle without the connection's key
edits, swaps, replays, truncates or injects frames between a real FrameWriter and a real WeightsStream
(over socket pairs); none of it may yield a chunk or a clean end. Each defence is held by a test that
fails without it: a constant nonce lets swapped and replayed frames through, a header left out of the
associated data lets an edited header through, unchecked END/KEEPALIVE tags let an injected END through.
And arbitrary bytes where frames belong never crash the reader, never hang it, and never make it
allocate more than a frame may announce."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overworld.model_registry.stream.protocol import (
    CALLER_SENDS,
    DATA,
    END,
    HEADER,
    KEEPALIVE,
    MAX_FRAME,
    SERVER_SENDS,
    TAG,
    FrameWriter,
    Stalled,
    StreamError,
    WeightsStream,
)

KEY = os.urandom(16)
CHUNK = 4096


def written(frames: list[tuple[str, int]], space: int = SERVER_SENDS) -> list[bytes]:
    """The bytes a real FrameWriter puts on the wire for each frame, one item per frame (header + sealed),
    sealed in `space` (the registry's, or a publishing caller's)."""
    out, sent = socket.socketpair()
    writer = FrameWriter(out, KEY, "test", space)
    wire = bytearray()
    sizes = []
    for kind, index in frames:
        before = len(wire)
        if kind == "data":
            writer.data(index, memoryview(bytes([index % 251]) * CHUNK))
        elif kind == "keepalive":
            writer.keepalive()
        else:
            writer.end()
        expected = HEADER.size + (CHUNK if kind == "data" else 0) + TAG
        while len(wire) - before < expected:
            wire += sent.recv(1 << 20)
        sizes.append(len(wire) - before)
    out.close()
    sent.close()
    items, at = [], 0
    for size in sizes:
        items.append(bytes(wire[at:at + size]))
        at += size
    return items


def read_all(wire: bytes, stall: float = 2.0, asked: list[int] | None = None,
             space: int = SERVER_SENDS) -> list[tuple[int, int, bytes]]:
    """What a real WeightsStream makes of `wire`: (kind, index, payload) per frame, until END; raises
    what the reader raises. `asked`: the length of every chunk buffer the reader asked for."""
    theirs, ours = socket.socketpair()

    def feed() -> None:
        with contextlib.suppress(OSError):  # the reader may have given up and closed its end
            theirs.sendall(wire)
            theirs.shutdown(socket.SHUT_WR)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    reader = WeightsStream(ours, KEY, stall, stall, lambda: False, space=space)
    out = []
    buffers: dict[int, bytearray] = {}

    def into(index: int, length: int) -> memoryview:
        if asked is not None:
            asked.append(length)
        if length > CHUNK:
            raise ValueError(f"chunk {index} of {length} bytes")
        buffers[index] = bytearray(length)
        return memoryview(buffers[index])

    try:
        while True:
            frame = reader.next(into)
            out.append((frame.kind, frame.index, bytes(buffers.get(frame.index, b"")) if frame.kind == DATA else b""))
            if frame.kind == END:
                return out
    finally:
        reader.close()
        feeder.join(5)
        theirs.close()


def honest() -> list[bytes]:
    return written([("data", 0), ("keepalive", 0), ("data", 1), ("data", 2), ("end", 0)])


def test_an_untouched_stream_reads_whole() -> None:
    got = read_all(b"".join(honest()))
    assert [(k, i) for k, i, _ in got] == [(DATA, 0), (KEEPALIVE, 0), (DATA, 1), (DATA, 2), (END, 0)]
    assert all(payload == bytes([i]) * CHUNK for k, i, payload in got if k == DATA)


def test_a_header_byte_changed_on_the_way_is_data_loss() -> None:
    frames = honest()
    edited = bytearray(frames[2])
    edited[4] ^= 0x01  # the chunk index of the second DATA frame: 1 -> 0
    with pytest.raises(StreamError) as err:
        read_all(b"".join([frames[0], frames[1], bytes(edited), *frames[3:]]))
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_swapped_frames_are_data_loss() -> None:
    frames = honest()
    with pytest.raises(StreamError) as err:
        read_all(b"".join([frames[0], frames[1], frames[3], frames[2], frames[4]]))
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_a_replayed_frame_is_data_loss() -> None:
    frames = honest()
    with pytest.raises(StreamError) as err:
        read_all(b"".join([frames[0], frames[1], frames[2], frames[2], *frames[3:]]))
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_a_truncated_stream_never_ends_clean() -> None:
    frames = honest()
    for cut in (frames[:4], [*frames[:4], frames[4][:HEADER.size + 3]]):
        with pytest.raises((ConnectionError, StreamError)):
            read_all(b"".join(cut))


def test_an_unsealed_end_is_not_an_end() -> None:
    """An END without its tag (a man in the middle has no key to make one), at the end of the bytes or
    before the real END (whose bytes a reader that skips an END's tag would take for that tag)."""
    frames = written([("data", 0), ("data", 1), ("end", 0)])
    injected = HEADER.pack(END, 0, 0)
    for wire in (b"".join([*frames[:2], injected]), b"".join([*frames[:2], injected, frames[2]])):
        with pytest.raises((ConnectionError, StreamError)):
            read_all(wire)


def test_a_keepalive_forged_from_another_connection_is_data_loss() -> None:
    """Frames of another connection (another key) spliced in: a keep-alive's tag is checked too."""
    global KEY
    mine = honest()
    KEY, theirs = os.urandom(16), KEY
    try:
        foreign = written([("keepalive", 0)])
    finally:
        KEY = theirs
    with pytest.raises(StreamError) as err:
        read_all(b"".join([mine[0], foreign[0], *mine[2:]]))
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_a_frame_sent_back_the_other_way_is_data_loss() -> None:
    """A publish's frames go to the registry and its answer comes back on one connection, under one key:
    each side seals in its own nonce space, so a frame reflected to its sender does not open there."""
    trainers = written([("data", 0), ("end", 0)], space=CALLER_SENDS)
    assert [k for k, _, _ in read_all(b"".join(trainers), space=CALLER_SENDS)] == [DATA, END]
    for wire, space in ((trainers, SERVER_SENDS), (honest(), CALLER_SENDS)):
        with pytest.raises(StreamError) as err:
            read_all(b"".join(wire), space=space)
        assert err.value.code == grpc.StatusCode.DATA_LOSS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_after_the_handshake_never_crash_or_hang_the_reader(junk: bytes) -> None:
    """Whatever comes instead of frames ends with one of the reader's own errors, within its stall time:
    nothing without the key makes a chunk or a clean end."""
    with pytest.raises((StreamError, ConnectionError, Stalled, ValueError)):
        read_all(junk, stall=0.5)


def _valid(kind: int, length: int) -> bool:
    return (kind == DATA and length <= MAX_FRAME) or (kind in (KEEPALIVE, END) and not length) or (
        kind == 4 and 1 <= length <= 2048)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.integers(0, 2**32 - 1), st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 64)))
def test_a_header_announcing_anything_is_refused_before_a_buffer_is_made(kind: int, index: int, length: int) -> None:
    """A header is checked before its frame is read: a kind or length beyond the protocol's is refused
    (INTERNAL) and no buffer is asked for; within it, a buffer of the announced length at most."""
    asked: list[int] = []
    with pytest.raises((StreamError, ConnectionError, Stalled, ValueError)) as err:
        read_all(HEADER.pack(kind, index, length), stall=0.5, asked=asked)
    if not _valid(kind, length):
        assert isinstance(err.value, StreamError) and err.value.code == grpc.StatusCode.INTERNAL
        assert asked == []
    assert all(n == length for n in asked)
