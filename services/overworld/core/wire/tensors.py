"""Raw tensors on the wire: safetensors bytes, optionally zlib-compressed. Never pickle."""

from __future__ import annotations

import zlib

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from overworld.v1 import common_pb2


class TensorDecodeError(ValueError):
    pass


def encode(tensors: dict[str, np.ndarray], compression: int = common_pb2.COMPRESSION_NONE) -> bytes:
    data = st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()})
    if compression == common_pb2.COMPRESSION_ZLIB:
        data = zlib.compress(data, 1)
    return data


def decode(data: bytes, compression: int = common_pb2.COMPRESSION_NONE, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    try:
        if compression == common_pb2.COMPRESSION_ZLIB:
            d = zlib.decompressobj()
            data = d.decompress(data, max_bytes or 0)
            if d.unconsumed_tail:
                raise TensorDecodeError(f"decompressed tensors exceed {max_bytes} bytes")
        elif compression != common_pb2.COMPRESSION_NONE:
            raise TensorDecodeError(f"unknown compression {compression}")
        return st_load(bytes(data))
    except TensorDecodeError:
        raise
    except Exception as err:  # safetensors raises several types for malformed input
        raise TensorDecodeError(f"tensors are not valid safetensors: {err}") from None
