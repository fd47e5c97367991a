"""The safetensors format without torch: the one parser of a payload's header and tensor entries
(`read_header`, `tensor_entries`, `parse`: as strict as the safetensors loader, never trusting a size
it has not checked against the bytes), a payload's floating dtype, and the cast of its floating
tensors to bfloat16 or float16 that the model-registry does for half-precision transfer. The parser's
callers: the cast here, the replay buffer's zero-copy views (replay_buffer/wire.py), and for the
header alone core/wire/weights.py and the registry's message bounds (model_registry/payload.py).

The registry runs in the services image, which has no torch: the cast is numpy's, rounded as torch
rounds (to nearest, ties to even; float64 through float32, as torch's scalar casts go), so that the
bytes are those `tensor.to(torch.bfloat16)` makes (tests/core/test_safetensors_format.py compares
them). The worker casts them back with torch (core/wire/weights.py).
"""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

import numpy as np
import safetensors

MAX_HEADER_BYTES = 100 << 20

# safetensors dtype -> (torch's name, bytes per element): the one table; core/wire/weights.py (torch) and
# replay_buffer/wire.py (numpy) derive theirs from it
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8), "BOOL": ("bool", 1),
}
FLOATING = {code: name for code, (name, _) in DTYPES.items() if code.startswith(("F", "BF"))}
# names accepted for half-precision transfer -> the dtype sent
HALF_PRECISIONS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                   "half": "float16"}


def half_precision(precision: str | bool) -> str | None:
    """'bfloat16' or 'float16' for a precision name ('' / False: None, True: bfloat16); ValueError if unknown."""
    if precision is True:
        return "bfloat16"
    if not precision:
        return None
    try:
        return HALF_PRECISIONS[str(precision).lower()]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}: use one of {sorted(HALF_PRECISIONS)}") from None


class SafetensorsError(ValueError):
    """Bytes that are not a valid safetensors payload."""


class Entry(NamedTuple):
    """One tensor of a payload: its safetensors dtype ('F32'), shape, and where its bytes lie in the
    payload (begin..end, offsets from the payload's first byte, not from the data section's)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names nothing twice (which JSON parsers resolve each their own way)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsError(f"not a safetensors payload: {key!r} given twice in the header")
        out[key] = value
    return out


def read_header(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """The safetensors header (name -> {dtype, shape, data_offsets}, plus `__metadata__`) and the
    offset where the tensor data starts. `buf` may end after the header: the entries are not checked
    here (`tensor_entries` does); the header's length, JSON (UTF-8, an object, no name twice) and
    metadata (strings) are. SafetensorsError (a ValueError) otherwise."""
    view = memoryview(buf)
    if len(view) < 8:
        raise SafetensorsError("not a safetensors payload: shorter than its header length")
    (n,) = struct.unpack("<Q", view[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(view):
        raise SafetensorsError(f"not a safetensors payload: header length {n} for {len(view)} bytes")
    try:
        header = json.loads(bytes(view[8:8 + n]).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SafetensorsError(f"not a safetensors payload: {err}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("not a safetensors payload: the header is not an object")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise SafetensorsError("not a safetensors payload: __metadata__ is not an object of strings")
    return header, 8 + n


def _sizes(value: Any, count: int | None) -> list[int] | None:
    """`value` as a list of sizes (ints in 0..2**64-1, as the loader's usize; `count` of them if given),
    or None."""
    if not isinstance(value, list) or count is not None and len(value) != count:
        return None
    if not all(type(v) is int and 0 <= v < 1 << 64 for v in value):  # not bool, not float
        return None
    return value


def tensor_entries(header: dict[str, Any], start: int, total: int) -> list[Entry]:
    """The tensors of a header (`read_header`) whose data starts at `start` in a payload of `total`
    bytes, by where their bytes lie, checked as strictly as the safetensors loader checks them: a
    known dtype, a shape and two data offsets of non-negative ints, as many bytes as the shape needs,
    and data that covers the data section exactly (no overlap, no gap, nothing after). The sizes are
    checked against `total`, never trusted. SafetensorsError (a ValueError) otherwise."""
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str) or meta["dtype"] not in DTYPES:
            raise SafetensorsError(f"tensor {name!r}: not an entry of a known dtype: {str(meta)[:200]}")
        shape, offsets = _sizes(meta.get("shape"), None), _sizes(meta.get("data_offsets"), 2)
        if shape is None or offsets is None:
            raise SafetensorsError(f"tensor {name!r}: bad shape or data_offsets: {str(meta)[:200]}")
        count = 1
        for d in shape:  # the loader refuses a product past 2**64 even where a later 0 would end it
            count *= d
            if count >= 1 << 64:
                raise SafetensorsError(f"tensor {name!r}: shape {shape} overflows")
        begin, end = offsets
        if not begin <= end <= total - start or end - begin != count * DTYPES[meta["dtype"]][1]:
            raise SafetensorsError(f"tensor {name!r}: data_offsets {offsets} do not fit shape {shape} "
                                   f"{meta['dtype']} in {total - start} bytes of data")
        entries.append(Entry(name, meta["dtype"], tuple(shape), start + begin, start + end))
    entries.sort(key=lambda e: (e.begin, e.end))
    position = start
    for entry in entries:
        if entry.begin != position:
            raise SafetensorsError(f"tensor {entry.name!r}: its data "
                                   f"{'overlaps another' if entry.begin < position else 'leaves a gap'}")
        position = entry.end
    if position != total:
        raise SafetensorsError(f"not a safetensors payload: {total - position} bytes after the data")
    return entries


def parse(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list[Entry]]:
    """The header of a whole payload and its checked tensors (`read_header`, `tensor_entries`)."""
    header, start = read_header(buf)
    return header, tensor_entries(header, start, len(memoryview(buf)))


def payload_dtype(buf: bytes | bytearray | memoryview) -> str:
    """The dtype of the floating tensors of a payload ('float32', 'bfloat16', 'mixed'; '' if none or
    not safetensors), for the registry manifest."""
    try:
        header, _ = read_header(buf)
    except ValueError:
        return ""
    names = {FLOATING[m["dtype"]] for k, m in header.items()
             if k != "__metadata__" and isinstance(m, dict) and m.get("dtype") in FLOATING}
    if not names:
        return ""
    return names.pop() if len(names) == 1 else "mixed"


def convert(data: bytes | bytearray | memoryview, precision: str) -> bytes:
    """The payload with every floating tensor cast to `precision` ('bfloat16' / 'float16'); other
    tensors and the metadata unchanged. ValueError for a payload that is not safetensors."""
    target = half_precision(precision)
    if target is None:
        return bytes(data)
    view = memoryview(data)
    header, entries = parse(view)
    specs: dict[str, Any] = {}
    keep_alive: list[Any] = []
    for name, code, shape, begin, end in entries:
        dtype = DTYPES[code][0]
        raw = view[begin:end]  # safetensors reads it through a pointer: `data` outlives the serialize
        if code in FLOATING and dtype != target:
            array = _cast(raw, code, target)
            keep_alive.append(array)
            dtype, raw = target, array.data.cast("B")  # array.data is memoryview(array)
        address = np.frombuffer(raw, dtype=np.uint8).ctypes.data
        specs[name] = safetensors.TensorSpec(dtype=dtype, shape=list(shape), data_ptr=address, data_len=len(raw))
    serialized = bytes(safetensors.serialize(specs, metadata=header.get("__metadata__")))
    del keep_alive
    return serialized


def _as_float32(raw: memoryview, dtype: str) -> np.ndarray:
    """The tensor's values as float32: exact for every floating dtype but float64, which rounds to
    nearest (as torch's cast of a double to bfloat16 or half does before it rounds again)."""
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4")
    if dtype == "F64":
        return np.frombuffer(raw, dtype="<f8").astype(np.float32)
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E5M2":  # the upper byte of a float16
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    return _E4M3FN[np.frombuffer(raw, dtype=np.uint8)]


CAST_BLOCK = 1 << 20  # elements cast at a time: the temporaries stay a few MB, whatever the tensor's size


def _cast(raw: memoryview, dtype: str, target: str) -> np.ndarray:
    """A floating tensor's bytes cast to `target`, block by block into one output array."""
    itemsize = DTYPES[dtype][1]
    count = len(raw) // itemsize
    out = np.empty(count, dtype="<f2" if target == "float16" else "<u2")
    for first in range(0, count, CAST_BLOCK):
        last = min(first + CAST_BLOCK, count)
        _cast_block(_as_float32(raw[first * itemsize:last * itemsize], dtype), target, out[first:last])
    return out


def _cast_block(values: np.ndarray, target: str, out: np.ndarray) -> None:
    if target == "float16":
        with np.errstate(over="ignore"):  # beyond float16's range: infinity, as torch gives
            out[:] = values
        return
    bits = values.view(np.uint32)
    # round to nearest, ties to even, on the upper 16 bits (c10::BFloat16's round_to_nearest_even)
    rounded = (bits >> 16) & 1
    rounded += np.uint32(0x7FFF)
    rounded += bits
    rounded >>= 16
    out[:] = rounded
    out[np.isnan(values)] = 0x7FC0


def _e4m3fn_values() -> np.ndarray:
    """float8_e4m3fn's 256 values as float32: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
    infinities, S.1111.111 is NaN."""
    out = np.empty(256, dtype=np.float32)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0xF and mantissa == 0x7:
            out[byte] = np.nan
        elif exponent == 0:
            out[byte] = sign * mantissa / 8 * 2.0 ** -6
        else:
            out[byte] = sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return out


_E4M3FN = _e4m3fn_values()
