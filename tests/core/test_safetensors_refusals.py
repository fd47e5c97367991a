"""Both callers of the one safetensors parser (core/wire/safetensors_format.py) refuse every malformed
payload the safetensors loader refuses, with the error each turns into a gRPC status: the registry's
half-precision cast (`convert`: ValueError -> FAILED_PRECONDITION) and the replay buffer's zero-copy
views (`wire.decode_views`: WireError -> the loader, which refuses: INVALID_ARGUMENT). No other
exception type escapes either, for these cases or for randomly corrupted payloads."""

from __future__ import annotations

import random

import numpy as np
import pytest
from safetensors.numpy import save

from overworld.core.wire import safetensors_format, tensors
from overworld.replay_buffer import wire
from tests.core.safetensors_cases import CASES

GOOD = save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(5, dtype=np.uint8),
             "c": np.zeros((0, 2), np.int64), "d": np.array(2.5, np.float64)}, metadata={"format": "np"})


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_payload_is_refused_by_both_callers(case: str) -> None:
    bad = CASES[case](GOOD)
    with pytest.raises(tensors.TensorDecodeError):  # the case is malformed: the loader says so
        tensors.decode(bad)
    with pytest.raises(ValueError):
        safetensors_format.convert(bad, "bfloat16")
    with pytest.raises(wire.WireError):
        wire.decode_views(memoryview(bad))


def test_a_valid_payload_is_read_alike_by_both_callers() -> None:
    full = tensors.decode(GOOD)
    views = wire.decode_views(memoryview(GOOD))
    half = tensors.decode(safetensors_format.convert(GOOD, "float16"))
    assert views.keys() == full.keys() == half.keys()
    for k in full:
        np.testing.assert_array_equal(views[k], full[k])
        assert half[k].shape == full[k].shape
        assert half[k].dtype == (np.float16 if full[k].dtype.kind == "f" else full[k].dtype)


def test_a_dtype_numpy_lacks_is_left_to_the_loader_by_the_views() -> None:
    bf16 = bytes(safetensors_format.convert(GOOD, "bfloat16"))
    with pytest.raises(wire.WireError, match="bfloat16|BF16"):
        wire.decode_views(memoryview(bf16))
    assert safetensors_format.payload_dtype(bf16) == "bfloat16"


@pytest.mark.parametrize("seed", range(3))
def test_a_corrupted_payload_is_refused_or_read_as_the_loader_reads_it(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        bad = bytearray(GOOD)
        how = rng.random()
        if how < 0.6:
            for _ in range(rng.randint(1, 3)):
                bad[rng.randrange(min(len(bad), 300))] = rng.randrange(256)
        elif how < 0.8:
            bad = bad[:rng.randrange(len(bad))]
        else:
            bad += bytes(rng.randrange(1, 16))
        try:
            full = tensors.decode(bytes(bad))
        except tensors.TensorDecodeError:
            full = None
        for read in (lambda b: safetensors_format.convert(b, "float16"), lambda b: wire.decode_views(memoryview(b))):
            try:
                read(bytes(bad))
            except ValueError:
                continue
            assert full is not None, f"accepted what the loader refuses: {bytes(bad[:200])!r}"


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_payload_is_refused_where_a_worker_reads_a_version(case: str) -> None:
    """core/wire/weights.py: a version read in place (from_buffer) or from its chunks (from_pieces), as the
    rollout worker's watcher does, goes through the same parser: ValueError, never a tensor."""
    from overworld.core.wire import weights

    bad = CASES[case](GOOD)
    with pytest.raises(ValueError):
        weights.from_buffer(bytearray(bad))
    half = len(bad) // 2
    with pytest.raises(ValueError):
        weights.from_pieces([(0, memoryview(bad)[:half]), (half, memoryview(bad)[half:])])
