"""The two primitives of protobuf's wire format that the zero-copy paths need (replay-buffer
chunks, registry weight chunks): encoding and reading a varint."""

from __future__ import annotations


class WireError(ValueError):
    """Bytes that are not the protobuf message they claim to be."""


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); WireError if the buffer ends first or the varint is overlong."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
