"""Zero-copy handling of the replay buffer's big messages (a fragment is ~3 MB of tensors).

The front stores a fragment exactly as the worker serialized it and sends it back exactly as stored,
so on the fast path (`server.add_to_server`) the payload is never parsed into protobuf objects nor
serialized again: the protobuf wire format is split by hand (two or three fields), the safetensors
payload is checked through numpy views on the received bytes, and sampled chunks are assembled as
wire bytes around the stored blobs.
"""

from __future__ import annotations

import math

import numpy as np

from overworld.core.wire import safetensors_format
from overworld.core.wire.protowire import WireError, read_varint, varint

# safetensors dtype names -> numpy (BF16 and F8 have no numpy dtype: those take the copying decoder)
DTYPES = {code: np.dtype(name) for code, (name, _) in safetensors_format.DTYPES.items() if hasattr(np, name)}


def length_delimited_fields(buf: memoryview) -> dict[int, memoryview]:
    """The length-delimited fields of a message, by field number (views, no copy). Any other wire
    type, or a field given twice (which protobuf would merge), raises WireError: callers then fall
    back to the protobuf parser."""
    out: dict[int, memoryview] = {}
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type != 2:
            raise WireError(f"field {number}: wire type {wire_type}")
        size, pos = read_varint(buf, pos)
        if pos + size > len(buf):
            raise WireError(f"field {number}: {size} bytes past the end")
        if number in out:
            raise WireError(f"field {number} given twice")
        out[number] = buf[pos:pos + size]
        pos += size
    return out


def decode_views(data: memoryview) -> dict[str, np.ndarray]:
    """Uncompressed safetensors bytes -> read-only numpy views on them, checked by the one parser
    (core/wire/safetensors_format.py) as strictly as the safetensors loader. WireError for a payload it
    refuses, or one with a dtype numpy lacks (bfloat16, float8): the caller leaves both to the loader."""
    try:
        _, entries = safetensors_format.parse(data)
    except safetensors_format.SafetensorsError as err:
        raise WireError(f"tensors are not valid safetensors: {err}") from None
    out = {}
    for name, code, shape, begin, end in entries:
        dtype = DTYPES.get(code)
        if dtype is None:
            raise WireError(f"tensor {name!r}: {code} has no numpy dtype")
        out[name] = (np.frombuffer(data, dtype, math.prod(shape), begin).reshape(shape) if end > begin
                     else np.empty(shape, dtype))
    return out


def sampled_chunk(chunk_id: int, blobs: list[bytes], times_sampled: int) -> bytes:
    """A serialized SampledChunk around stored, serialized Fragments (fields 1, 2 repeated, 3)."""
    parts = [b"\x08", varint(chunk_id)]
    for blob in blobs:
        parts += [b"\x12", varint(len(blob)), blob]
    parts += [b"\x18", varint(times_sampled)]
    return b"".join(parts)
