"""Malformed safetensors payloads, each made from a valid one: the one table that the tests of both
parsers' callers use (the registry's half-precision cast, core/wire/safetensors_format.py; the replay
buffer's zero-copy views, replay_buffer/wire.py). The safetensors loader refuses every one of them,
so neither caller may accept any."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

Header = dict[str, Any]


def split(good: bytes) -> tuple[Header, bytes]:
    (n,) = struct.unpack_from("<Q", good)
    return json.loads(good[8:8 + n]), good[8 + n:]


def join(header: Header | bytes, body: bytes, n: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n is None else n) + raw + body


def _tensors(header: Header) -> list[str]:
    """The names of the tensors of one dimension or more that have data, by where it lies."""
    return sorted((k for k, e in header.items()
                   if k != "__metadata__" and e["shape"] and e["data_offsets"][1] > e["data_offsets"][0]),
                  key=lambda k: header[k]["data_offsets"])


def _edit(change: Callable[[Header, list[str]], None]) -> Callable[[bytes], bytes]:
    def make(good: bytes) -> bytes:
        header, body = split(good)
        change(header, _tensors(header))
        return join(header, body)
    return make


def _set(key: str, value: Callable[[dict[str, Any]], Any], which: int = 0) -> Callable[[bytes], bytes]:
    def change(header: Header, names: list[str]) -> None:
        entry = header[names[which]]
        entry[key] = value(entry)
    return _edit(change)


def _overlap(header: Header, names: list[str]) -> None:
    # the last tensor reads the first one's bytes again (its own bytes are left over at the end)
    first, last = header[names[0]], header[names[-1]]
    size = last["data_offsets"][1] - last["data_offsets"][0]
    last["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + size]


def _duplicate(good: bytes) -> bytes:
    # a name given again, last, for no data: that tensor's bytes are left uncovered
    header, body = split(good)
    raw = json.dumps(header)
    extra = json.dumps({_tensors(header)[0]: {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})[1:-1]
    return join((raw[:-1] + ", " + extra + "}").encode(), body)


# name -> (a valid payload -> the malformed payload); a valid payload given has at least two tensors
# with data
CASES: dict[str, Callable[[bytes], bytes]] = {
    "shorter than the header length": lambda good: good[:5],
    "empty": lambda good: b"",
    "header length past the end": lambda good: struct.pack("<Q", len(good)) + good[8:],
    "header length of 2**64 - 1": lambda good: b"\xff" * 8 + good[8:],
    "header not JSON": lambda good: join(b"{not json" + b" " * 7, split(good)[1]),
    "header not UTF-8": lambda good: join(b'{"\xff": 1}', split(good)[1]),
    "header not an object": lambda good: join(b"[1, 2]", split(good)[1]),
    "empty header": lambda good: join(b"", split(good)[1]),
    "entry not an object": _edit(lambda h, names: h.__setitem__(names[0], [1, 2])),
    "unknown dtype": _set("dtype", lambda e: "F7"),
    "dtype not a string": _set("dtype", lambda e: 4),
    "no shape": _edit(lambda h, names: h[names[0]].pop("shape")),
    "no data_offsets": _edit(lambda h, names: h[names[0]].pop("data_offsets")),
    "shape not a list": _set("shape", lambda e: "2"),
    "negative dimensions": _set("shape", lambda e: [-1, *(-d for d in e["shape"][:1]), *e["shape"][1:]]),
    "boolean dimension": _set("shape", lambda e: [True, *e["shape"]]),
    "float dimension": _set("shape", lambda e: [float(d) for d in e["shape"]]),
    "string dimension": _set("shape", lambda e: [str(d) for d in e["shape"]]),
    "shape larger than the data": _set("shape", lambda e: [e["shape"][0] + 1, *e["shape"][1:]]),
    "shape smaller than the data": _set("shape", lambda e: [e["shape"][0] - 1, *e["shape"][1:]]),
    "one data offset": _set("data_offsets", lambda e: e["data_offsets"][:1]),
    "three data offsets": _set("data_offsets", lambda e: [*e["data_offsets"], e["data_offsets"][1]]),
    "negative data offsets": _set("data_offsets", lambda e: [-1, e["data_offsets"][1] - e["data_offsets"][0] - 1]),
    "data offsets reversed": _set("data_offsets", lambda e: e["data_offsets"][::-1]),
    "float data offsets": _set("data_offsets", lambda e: [float(o) for o in e["data_offsets"]]),
    "data offsets past the end": _set("data_offsets", lambda e: [o + 1 << 40 for o in e["data_offsets"]], -1),
    "data offsets 2**64 apart": _set("data_offsets", lambda e: [0, 1 << 64]),
    "overlapping data": _edit(_overlap),
    "a name given twice": _duplicate,
    "trailing bytes": lambda good: good + b"\x00" * 8,
    "data cut short": lambda good: good[:-1],
    "metadata not an object": _edit(lambda h, names: h.__setitem__("__metadata__", ["format", "pt"])),
    "metadata value not a string": _edit(lambda h, names: h.__setitem__("__metadata__", {"format": 1})),
}
