"""Zero-copy handling of the replay buffer's big messages (a fragment is ~3 MB of tensors).

The front stores a fragment exactly as the worker serialized it and sends it back exactly as stored,
so on the fast path (`server.add_to_server`) the payload is never parsed into protobuf objects nor
serialized again: the protobuf wire format is split by hand (two or three fields), the safetensors
payload is checked through numpy views on the received bytes, and sampled chunks are assembled as
wire bytes around the stored blobs.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np

from overworld.core import safetensors_format
from overworld.core.protowire import WireError, read_varint, varint

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
    """Uncompressed safetensors bytes -> read-only numpy views on them, checked as strictly as the
    safetensors loader (header bounds, known dtypes, sizes, contiguous non-overlapping data)."""
    if len(data) < 8:
        raise WireError("tensors are not valid safetensors: shorter than the 8-byte header size")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > len(data) - 8:
        raise WireError(f"tensors are not valid safetensors: header of {n} bytes past the end")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"tensors are not valid safetensors: header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise WireError("tensors are not valid safetensors: header is not an object")
    body = data[8 + n:]
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
            raise WireError(f"tensor {name!r}: unsupported entry {info!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise WireError(f"tensor {name!r}: bad shape or data_offsets")
        dtype = np.dtype(DTYPES[info["dtype"]])
        begin, end = offsets
        if not 0 <= begin <= end <= len(body) or end - begin != math.prod(shape) * dtype.itemsize:
            raise WireError(f"tensor {name!r}: data_offsets {offsets} do not fit shape {shape} {info['dtype']}")
        entries.append((begin, end, name, dtype, shape))
    entries.sort()
    position = 0
    for begin, end, name, _, _ in entries:
        if begin != position:
            raise WireError(f"tensor {name!r}: data is not contiguous")
        position = end
    if position != len(body):
        raise WireError("tensors are not valid safetensors: trailing bytes after the data")
    return {name: np.frombuffer(body, dtype, math.prod(shape), begin).reshape(shape) if end > begin
            else np.empty(shape, dtype) for begin, end, name, dtype, shape in entries}


def sampled_chunk(chunk_id: int, blobs: list[bytes], times_sampled: int) -> bytes:
    """A serialized SampledChunk around stored, serialized Fragments (fields 1, 2 repeated, 3)."""
    parts = [b"\x08", varint(chunk_id)]
    for blob in blobs:
        parts += [b"\x12", varint(len(blob)), blob]
    parts += [b"\x18", varint(times_sampled)]
    return b"".join(parts)
