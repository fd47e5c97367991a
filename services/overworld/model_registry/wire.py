"""Hand-rolled protobuf wire encoding for the two bulk messages of the registry: `WeightsChunk` (Fetch
responses) and `PublishRequest` (Publish requests).

Why: a weights chunk is a few MB of bytes behind a few bytes of header. Through the generated
classes every chunk is copied three times in Python (slice, message construction, serialisation) on
the sending side and twice (parse, `.data`) on the receiving side. Here the registry encodes each
chunk of a version once and sends the same `bytes` to every watcher, and a receiver gets a
`memoryview` into the message gRPC handed it. The bytes on the wire are exactly what the generated
classes produce (tests/model_registry/test_registry.py, `test_hand_encoded_messages_are_what_protobuf_makes`,
checks it), so a client or server built from the generated stubs alone talks to these unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

from overworld.core.wire.protowire import read_varint, varint
from overworld.v1 import model_registry_pb2 as pb

# field number << 3 | wire type
_CHUNK_OFFSET = 2 << 3 | 0  # WeightsChunk.offset (varint)
_CHUNK_DATA = 3 << 3 | 2  # WeightsChunk.data (bytes)
_PUBLISH_CHUNK = 2 << 3 | 2  # PublishRequest.chunk (bytes)


def _fields(raw: bytes | memoryview) -> list[tuple[int, int | memoryview]]:
    """(field number, value) of each field: an int for varints and fixed ints, a memoryview for bytes."""
    buf = memoryview(raw)
    pos = 0
    out: list[tuple[int, int | memoryview]] = []
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        field, kind = key >> 3, key & 7
        if kind == 0:
            value, pos = read_varint(buf, pos)
            out.append((field, value))
        elif kind == 2:
            length, pos = read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated length-delimited field")
            out.append((field, buf[pos:pos + length]))
            pos += length
        elif kind == 1:
            out.append((field, int.from_bytes(buf[pos:pos + 8], "little")))
            pos += 8
        elif kind == 5:
            out.append((field, int.from_bytes(buf[pos:pos + 4], "little")))
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {kind}")
    return out


# -- WeightsChunk ---------------------------------------------------------------------------------

def varint_padded(value: int, size: int) -> bytes:
    """`value` as a varint of exactly `size` bytes (overlong: continuation bytes carrying zeros, which
    protobuf parsers accept)."""
    out = bytearray(varint(value))
    if len(out) > size:
        raise ValueError(f"{value} needs {len(out)} varint bytes, more than {size}")
    if len(out) < size:
        out[-1] |= 0x80
        out += b"\x80" * (size - len(out) - 1) + b"\x00"
    return bytes(out)


def chunk_header(offset: int, length: int, align: int = 1) -> bytes:
    """The bytes that precede `length` bytes of data in an encoded WeightsChunk at `offset`.

    With align > 1 the varints are padded so that the data starts at a multiple of `align` inside
    the message: a receiver can view tensors in the message it received without copying them to
    align them. With align 1: exactly what SerializeToString makes."""
    if align <= 1 or not length:
        head = (bytes([_CHUNK_OFFSET]) + varint(offset)) if offset else b""
        return head + (bytes([_CHUNK_DATA]) + varint(length) if length else b"")
    lo, ll = len(varint(offset)), len(varint(length))
    total = 2 + lo + ll
    extra = -total % align
    if extra > (10 - lo) + (10 - ll):  # cannot pad that far: unaligned
        return chunk_header(offset, length)
    pad_offset = min(extra, 10 - lo)
    return (bytes([_CHUNK_OFFSET]) + varint_padded(offset, lo + pad_offset)
            + bytes([_CHUNK_DATA]) + varint_padded(length, ll + extra - pad_offset))


def encode_chunk(offset: int, data: bytes | bytearray | memoryview, align: int = 1) -> bytes:
    """`WeightsChunk(offset=offset, data=data)` on the wire with a single copy of data (byte for
    byte what SerializeToString makes when align is 1)."""
    return b"".join((chunk_header(offset, len(data), align), data))


def encode_info_chunk(info: pb.VersionInfo, offset: int) -> bytes:
    """The first message of a Fetch stream: the version's info and the offset, no data."""
    return pb.WeightsChunk(info=info, offset=offset).SerializeToString()


class Chunk(NamedTuple):
    info: pb.VersionInfo | None
    offset: int
    data: memoryview  # a view into the received message: no copy


def decode_chunk(raw: bytes) -> Chunk:
    info: pb.VersionInfo | None = None
    offset = 0
    data = memoryview(b"")
    for field, value in _fields(raw):
        if field == 1 and isinstance(value, memoryview):
            info = pb.VersionInfo.FromString(bytes(value))
        elif field == 2 and isinstance(value, int):
            offset = value
        elif field == 3 and isinstance(value, memoryview):
            data = value
    return Chunk(info, offset, data)


# -- PublishRequest -------------------------------------------------------------------------------

def encode_publish_chunk(data: bytes | bytearray | memoryview) -> bytes:
    """`PublishRequest(chunk=data).SerializeToString()` with a single copy of data."""
    return b"".join((bytes([_PUBLISH_CHUNK]), varint(len(data)), data))


def encode_publish_manifest(manifest: pb.VersionInfo) -> bytes:
    return pb.PublishRequest(manifest=manifest).SerializeToString()


def encode_publish_sha256(sha256: str) -> bytes:
    return pb.PublishRequest(sha256=sha256).SerializeToString()


class PublishPart(NamedTuple):
    """One PublishRequest: exactly one of the three is set (none for an empty message)."""

    manifest: pb.VersionInfo | None = None
    chunk: memoryview | None = None
    sha256: str | None = None


def decode_publish(raw: bytes) -> PublishPart:
    """A PublishRequest as a PublishPart with a view of the chunk (no copy); the last field present
    wins, as in protobuf's oneof."""
    part = PublishPart()
    for field, value in _fields(raw):
        if field == 1 and isinstance(value, memoryview):
            part = PublishPart(manifest=pb.VersionInfo.FromString(bytes(value)))
        elif field == 2 and isinstance(value, memoryview):
            part = PublishPart(chunk=value)
        elif field == 3 and isinstance(value, memoryview):
            try:
                part = PublishPart(sha256=bytes(value).decode())
            except UnicodeDecodeError:
                raise ValueError("PublishRequest.sha256 is not UTF-8") from None
    return part


def publish_part(request: pb.PublishRequest) -> PublishPart:
    """The same view of a PublishRequest parsed by the generated classes."""
    kind = request.WhichOneof("kind")
    if kind == "manifest":
        return PublishPart(manifest=request.manifest)
    if kind == "chunk":
        return PublishPart(chunk=memoryview(request.chunk))
    if kind == "sha256":
        return PublishPart(sha256=request.sha256)
    return PublishPart()
