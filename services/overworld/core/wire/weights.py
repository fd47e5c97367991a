"""Model weights as safetensors bytes (the registry's payload), optionally in half precision.

`to_bytes` / `from_bytes` are the plain conversions. `from_buffer` and `from_pieces` read a
safetensors payload without copying it: every tensor is a view into the given buffer (or into the
received message that holds it), which the tensors keep alive. `convert` (core/wire/safetensors_format.py,
without torch) casts the floating tensors of a payload to bfloat16 or float16 (the registry's
half-precision transfer); the receiver casts them back with `from_buffer(..., like=model_state)`.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

# torch-free (the registry's half-precision transfer in the services image): core/wire/safetensors_format.py
from overworld.core.wire import safetensors_format
from overworld.core.wire.safetensors_format import MAX_HEADER_BYTES, read_header

__all__ = ["DTYPES", "dtype_name", "from_buffer", "from_bytes", "from_pieces", "half_dtype", "tensor_entries", "to_bytes"]

# safetensors dtype names -> torch dtypes
DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, (name, _) in safetensors_format.DTYPES.items()}


def half_dtype(precision: str | bool) -> torch.dtype | None:
    """The torch dtype for a precision name ('' / False: None, True: bfloat16); ValueError if unknown."""
    name = safetensors_format.half_precision(precision)
    return None if name is None else getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_bytes(state_dict: dict[str, torch.Tensor], half: bool | str = False) -> bytes:
    """safetensors bytes of a state dict; `half` (True = bfloat16, or 'bfloat16' / 'float16') casts the
    floating tensors."""
    target = half_dtype(half)
    out = {}
    for k, v in state_dict.items():
        v = v.detach().to("cpu").contiguous()
        if target is not None and v.is_floating_point():
            v = v.to(target)
        out[k] = v
    return st_save(out)


def from_bytes(data: bytes, like: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    tensors = st_load(data)
    if like is not None:
        tensors = {k: v.to(like[k].dtype) if k in like else v for k, v in tensors.items()}
    return tensors


def tensor_entries(header: dict[str, Any], start: int, total: int
                   ) -> Iterator[tuple[str, torch.dtype, list[int], int, int, int, int]]:
    """(name, dtype, shape, count, itemsize, begin, end) of each tensor of a safetensors header whose
    data starts at `start` in a payload of `total` bytes; begin/end are offsets in the payload. Checked
    by the one parser (safetensors_format.tensor_entries): a malformed payload is a ValueError."""
    for entry in safetensors_format.tensor_entries(header, start, total):
        itemsize = safetensors_format.DTYPES[entry.dtype][1]
        yield (entry.name, DTYPES[entry.dtype], list(entry.shape), math.prod(entry.shape), itemsize,
               entry.begin, entry.end)


def from_buffer(buf: bytearray | memoryview, like: dict[str, torch.Tensor] | None = None,
                size: int | None = None) -> dict[str, torch.Tensor]:
    """Tensors of the safetensors payload in buf[:size], as views into buf (no copy; buf must be
    writable, and is kept alive by the tensors). With `like`, a tensor whose dtype differs from
    like's is cast (a copy)."""
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("from_buffer needs a writable buffer (use from_bytes for bytes)")
    if size is not None:
        view = view[:size]
    header, start = read_header(view)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, count, itemsize, begin, end in tensor_entries(header, start, len(view)):
        if count == 0:
            tensor = torch.empty(shape, dtype=dtype)
        elif begin % itemsize:  # misaligned (not written by safetensors): copy
            tensor = torch.frombuffer(bytearray(view[begin:end]), dtype=dtype).reshape(shape)
        else:
            tensor = torch.frombuffer(view, dtype=dtype, count=count, offset=begin).reshape(shape)
        if like is not None and name in like and like[name].dtype != dtype:
            tensor = tensor.to(like[name].dtype)
        out[name] = tensor
    return out


def from_pieces(pieces: list[tuple[int, memoryview]], like: dict[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors payload received as consecutive pieces (offset, bytes), e.g. the
    messages of a registry Fetch. A tensor that lies inside one piece, aligned, is a view into it (no
    copy); others are assembled (a copy). Views into `bytes` share read-only memory: treat the
    tensors as read-only (load_state_dict copies them or, with assign=True, adopts them: both fine).
    With `like`, a tensor whose dtype differs from like's is cast."""
    if not pieces:
        raise ValueError("not a safetensors payload: no bytes")
    starts = [offset for offset, _ in pieces]
    ends = [offset + len(data) for offset, data in pieces]

    def span(begin: int, end: int) -> memoryview:
        """Bytes [begin, end) of the payload: a view when one piece holds them, else a copy."""
        i = bisect.bisect_right(starts, begin) - 1
        if i < 0 or begin >= ends[i] and end > begin:
            raise ValueError(f"no piece holds offset {begin}")
        if end <= ends[i]:
            return pieces[i][1][begin - starts[i]:end - starts[i]]
        out = bytearray(end - begin)
        pos = begin
        while pos < end:
            if i >= len(pieces) or not starts[i] <= pos < ends[i]:
                raise ValueError(f"the pieces leave a gap at offset {pos}")
            take = min(end, ends[i]) - pos
            out[pos - begin:pos - begin + take] = pieces[i][1][pos - starts[i]:pos - starts[i] + take]
            pos += take
            i += 1
        return memoryview(out)

    n = int.from_bytes(span(0, 8), "little")
    if n > MAX_HEADER_BYTES or 8 + n > ends[-1]:
        raise ValueError(f"not a safetensors payload: header length {n} for {ends[-1]} bytes")
    header, start = read_header(bytes(span(0, 8 + n)))
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # a view into bytes is not writable memory: the tensors are documented as read-only
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, dtype, shape, count, itemsize, begin, end in tensor_entries(header, start, ends[-1]):
            if count == 0:
                tensor = torch.empty(shape, dtype=dtype)
            else:
                tensor = torch.frombuffer(span(begin, end), dtype=dtype, count=count).reshape(shape)
                if tensor.data_ptr() % itemsize:  # misaligned inside its piece: copy
                    tensor = tensor.clone()
            if like is not None and name in like and like[name].dtype != dtype:
                tensor = tensor.to(like[name].dtype)
            out[name] = tensor
    return out
