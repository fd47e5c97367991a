"""The safetensors format without torch: a payload's header, its floating dtype, and the cast of its
floating tensors to bfloat16 or float16 that the model-registry does for half-precision transfer.

The registry runs in the services image, which has no torch: the cast is numpy's, rounded as torch
rounds (to nearest, ties to even; float64 through float32, as torch's scalar casts go), so that the
bytes are those `tensor.to(torch.bfloat16)` makes (tests/core/test_safetensors_format.py compares
them). The worker casts them back with torch (core/weights.py).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
import safetensors

MAX_HEADER_BYTES = 100 << 20

# safetensors dtype -> (torch's name, bytes per element): the one table; core/weights.py (torch) and
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


def read_header(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """The safetensors header (name -> {dtype, shape, data_offsets}, plus `__metadata__`) and the
    offset where the tensor data starts."""
    view = memoryview(buf)
    if len(view) < 8:
        raise ValueError("not a safetensors payload: shorter than its header length")
    (n,) = struct.unpack("<Q", view[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(view):
        raise ValueError(f"not a safetensors payload: header length {n} for {len(view)} bytes")
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"not a safetensors payload: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors payload: the header is not an object")
    return header, 8 + n


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
    header, start = read_header(view)
    metadata = header.get("__metadata__")
    specs: dict[str, Any] = {}
    keep_alive: list[Any] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, itemsize = DTYPES[meta["dtype"]]
            shape = [int(d) for d in meta["shape"]]
            begin, end = (int(x) + start for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"bad safetensors entry for {name!r}: {err}") from None
        if end - begin != math.prod(shape) * itemsize or begin < start or end > len(view):
            raise ValueError(f"bad safetensors offsets for {name!r}: {begin - start}..{end - start} "
                             f"for {math.prod(shape)} x {dtype}")
        raw = view[begin:end]  # safetensors reads it through a pointer: `data` outlives the serialize
        if meta["dtype"] in FLOATING and dtype != target:
            array = _cast(raw, meta["dtype"], target)
            keep_alive.append(array)
            dtype, raw = target, array.data.cast("B")  # array.data is memoryview(array)
        address = np.frombuffer(raw, dtype=np.uint8).ctypes.data
        specs[name] = safetensors.TensorSpec(dtype=dtype, shape=shape, data_ptr=address, data_len=len(raw))
    serialized = bytes(safetensors.serialize(specs, metadata=metadata))
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
