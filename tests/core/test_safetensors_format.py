"""The registry's half-precision cast without torch (core/wire/safetensors_format.py) makes the bytes that
torch's cast makes, for every floating dtype safetensors has, and leaves the rest alone."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from overworld.core.wire import safetensors_format, weights


def torch_convert(data: bytes, precision: str) -> bytes:
    """The cast as the registry made it with torch (before the services image dropped torch)."""
    header, _ = safetensors_format.read_header(data)
    target = weights.half_dtype(precision)
    tensors = weights.from_buffer(bytearray(data))
    return save({k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()},
                metadata=header.get("__metadata__"))


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-40, 3.4e38, 65504.0, 65520.0, 1e-8,
                          6e-5, 1.0000001, 1.00390625, 1.01171875, 1.0078125])
    float8 = torch.arange(256, dtype=torch.uint8)
    return {
        "f32": torch.cat([torch.randn(20_000, generator=g) * 1000, edges, torch.randn(500, generator=g) * 1e-6]),
        "f64": torch.randn(5000, generator=g, dtype=torch.float64) * 1e3,
        "f16": torch.randn(5000, generator=g).to(torch.float16),
        "bf16": torch.randn(5000, generator=g).to(torch.bfloat16),
        # every float8 value but the NaNs (whose bits torch's vector and scalar casts choose differently)
        "e4m3": float8[~torch.isnan(float8.view(torch.float8_e4m3fn).float())].view(torch.float8_e4m3fn),
        "e5m2": float8[~torch.isnan(float8.view(torch.float8_e5m2).float())].view(torch.float8_e5m2),
        "i64": torch.arange(10), "flags": torch.tensor([True, False]), "u8": torch.arange(7, dtype=torch.uint8),
        "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5), "grid": torch.randn(3, 4, 5, generator=g),
    }


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_cast_is_torchs_to_the_byte(precision: str) -> None:
    data = save(every_dtype(), metadata={"format": "pt"})
    converted = safetensors_format.convert(data, precision)
    assert converted == torch_convert(data, precision)
    assert safetensors_format.payload_dtype(converted) == safetensors_format.half_precision(precision)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_tensor_of_several_cast_blocks_is_cast_whole(precision: str) -> None:
    g = torch.Generator().manual_seed(1)
    blocks = {"big": torch.randn(2 * safetensors_format.CAST_BLOCK + 3, generator=g) * 100,
              "f64": torch.randn(safetensors_format.CAST_BLOCK + 1, generator=g, dtype=torch.float64)}
    data = save(blocks)
    assert safetensors_format.convert(data, precision) == torch_convert(data, precision)


def test_nan_stays_nan_and_nothing_else_changes() -> None:
    data = save({"w": torch.tensor([float("nan"), 1.0, -2.5]), "n": torch.tensor([3, 4])})
    back = weights.from_bytes(safetensors_format.convert(data, "bfloat16"))
    assert torch.isnan(back["w"][0]) and back["w"][1:].tolist() == [1.0, -2.5] and back["n"].tolist() == [3, 4]
    assert safetensors_format.convert(data, "") == data


def test_dtypes_and_refusals() -> None:
    assert safetensors_format.payload_dtype(save({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.int8)})) == (
        "float32")
    assert safetensors_format.payload_dtype(b"not safetensors") == ""
    with pytest.raises(ValueError, match="unknown precision"):
        safetensors_format.half_precision("int4")
    with pytest.raises(ValueError, match="not a safetensors payload"):
        safetensors_format.convert(b"\x00" * 4, "bfloat16")
