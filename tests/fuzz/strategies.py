"""Hypothesis strategies for hostile gRPC requests: random and truncated bytes, messages built from
the proto descriptors with extreme scalars (negative and overflowing counters, NaN/Inf, unknown enum
values and versions, long strings), and tensor payloads (safetensors) with NaN/Inf, wrong shapes and
dtypes, and declared sizes far above what is sent."""

from __future__ import annotations

import functools
import json
import struct
import zlib
from typing import Any

import numpy as np
from google.protobuf import descriptor as d
from google.protobuf import message_factory
from hypothesis import strategies as st
from safetensors.numpy import save as st_save

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
EDGE_INTS = [0, 1, -1, 2, 7, 8, 255, 256, 2**31 - 1, -(2**31), 2**32 - 1, 2**53, 2**63 - 1, -(2**63), 2**64 - 1]
EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e38, -1e38, 1e308, float("nan"), float("inf"), float("-inf")]
DTYPES = ["float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool"]


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([v for v in EDGE_INTS if lo <= v <= hi]), st.integers(lo, hi))


def _floats(width: int) -> st.SearchStrategy[float]:
    edges = [v for v in EDGE_FLOATS if width == 64 or abs(v) < 3.4e38 or v != v or abs(v) == float("inf")]
    return st.one_of(st.sampled_from(edges), st.floats(width=width, allow_nan=True, allow_infinity=True))


def _arrays() -> st.SearchStrategy[np.ndarray]:
    def build(dtype: str, shape: list[int], fill: float) -> np.ndarray:
        return np.full(shape, fill if np.dtype(dtype).kind == "f" else 1, dtype=dtype)

    return st.builds(build, st.sampled_from(DTYPES), st.lists(st.integers(0, 9), max_size=4),
                     st.sampled_from([0.0, 1.0, float("nan"), float("inf"), float("-inf")]))


def _lying_safetensors(declared: int, shape: list[int], offsets: list[int]) -> bytes:
    """A safetensors file whose header declares sizes it does not have."""
    header = json.dumps({"x": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}).encode()
    return struct.pack("<Q", declared if declared else len(header)) + header + b"\0" * 16


@functools.cache
def zip_bomb() -> bytes:
    """~256 MiB of zeros, zlib-compressed to ~256 KiB (made once)."""
    return zlib.compress(b"\0" * (256 << 20), 9)


def tensor_payloads() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.dictionaries(st.sampled_from(["obs", "reward", "value", "action", "x", "", "é"]), _arrays(),
                        max_size=4).map(lambda t: st_save(t) if t else b""),
        st.builds(_lying_safetensors, st.sampled_from([0, 2**32, 2**63, 100_000_000]),
                  st.lists(st.sampled_from([0, 1, 2**20, 2**40, -1]), max_size=3),
                  st.lists(st.sampled_from([0, 16, 2**40, -1]), min_size=2, max_size=2)),
        st.binary(max_size=64),
        st.just(b"zip-bomb").map(lambda _: zip_bomb()),
    )


def _field(field: d.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t == d.FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    if t in (d.FieldDescriptor.TYPE_DOUBLE,):
        return _floats(64)
    if t == d.FieldDescriptor.TYPE_FLOAT:
        return _floats(32)
    if t in (d.FieldDescriptor.TYPE_INT32, d.FieldDescriptor.TYPE_SINT32, d.FieldDescriptor.TYPE_SFIXED32,
             d.FieldDescriptor.TYPE_ENUM):
        return _ints(*INT32)
    if t in (d.FieldDescriptor.TYPE_INT64, d.FieldDescriptor.TYPE_SINT64, d.FieldDescriptor.TYPE_SFIXED64):
        return _ints(*INT64)
    if t in (d.FieldDescriptor.TYPE_UINT32, d.FieldDescriptor.TYPE_FIXED32):
        return _ints(0, 2**32 - 1)
    if t in (d.FieldDescriptor.TYPE_UINT64, d.FieldDescriptor.TYPE_FIXED64):
        return _ints(0, 2**64 - 1)
    if t == d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == d.FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=24), st.sampled_from(["latest", "reference", "best", "../../etc",
                                                                "a" * 5000, "\0", "run", "w1"]))
    if t == d.FieldDescriptor.TYPE_BYTES:
        if field.name in ("tensors", "data", "chunk", "config_yaml"):
            return st.one_of(tensor_payloads(), st.binary(max_size=128))
        return st.binary(max_size=64)
    raise AssertionError(f"unhandled field type {t} of {field.full_name}")


def messages(descriptor: d.Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Instances of the message type, every field possibly set to an extreme value."""
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())

    @st.composite
    def build(draw: Any) -> Any:
        msg = cls()
        for field in descriptor.fields:
            if not draw(st.booleans()):
                continue
            is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
            if is_map:
                key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                entries = draw(st.dictionaries(_field(key_f, depth), _field(value_f, depth), max_size=3))
                target = getattr(msg, field.name)
                for k, v in entries.items():
                    if value_f.type == d.FieldDescriptor.TYPE_MESSAGE:
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif field.is_repeated:
                values = draw(st.lists(_field(field, depth), max_size=3))
                if field.type == d.FieldDescriptor.TYPE_MESSAGE:
                    getattr(msg, field.name).extend(values)
                else:
                    getattr(msg, field.name).extend(values)
            elif field.type == d.FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, field.name).CopyFrom(draw(_field(field, depth)))
            else:
                setattr(msg, field.name, draw(_field(field, depth)))
        return msg

    return build()


BATCH = 8  # cases derived from one drawn message


def _flip(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    if not data:
        return bytes(v for _, v in flips)
    out = bytearray(data)
    for at, value in flips:
        out[at % len(out)] = value
    return bytes(out)


@st.composite
def _variants(draw: Any, descriptor: d.Descriptor) -> list[bytes]:
    """BATCH requests on the wire from one drawn message (the costly draw): the message, two
    truncations, two corruptions, trailing garbage, the message twice (fields merge), random bytes."""
    whole = draw(messages(descriptor)).SerializeToString()
    cuts = draw(st.lists(st.floats(0, 1), min_size=2, max_size=2))
    flips = st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), min_size=1, max_size=4)
    noise = draw(st.binary(max_size=512))
    return [whole, *(whole[: int(len(whole) * c)] for c in cuts), _flip(whole, draw(flips)),
            _flip(whole, draw(flips)), whole + noise[:16], whole + whole, noise]


def batches(descriptor: d.Descriptor, client_streaming: bool) -> st.SearchStrategy[list[tuple[list[bytes], bool]]]:
    """BATCH cases (messages, cancel): one message for a unary request, 0-4 for a stream; cancel cuts
    the call right after it started (a client gone mid-stream), one case in eight."""

    @st.composite
    def build(draw: Any) -> list[tuple[list[bytes], bool]]:
        variants = draw(_variants(descriptor))
        cancelled = draw(st.integers(0, BATCH - 1))
        if not client_streaming:
            return [([v], i == cancelled) for i, v in enumerate(variants)]
        picks = st.lists(st.sampled_from(variants), max_size=4)
        return [(draw(picks), i == cancelled) for i in range(BATCH)]

    return build()
