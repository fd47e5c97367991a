"""The zero-copy safetensors check accepts exactly what the safetensors loader accepts, with equal arrays."""

from __future__ import annotations

import random

import numpy as np
import pytest
from rb_support import SPACES, fragment_data

from overworld.core.wire import tensors
from overworld.replay_buffer import wire
from overworld.v1 import common_pb2, replay_buffer_pb2


def _both(data: bytes):
    try:
        views = wire.decode_views(memoryview(data))
    except wire.WireError:
        views = None
    try:
        full = tensors.decode(data)
    except tensors.TensorDecodeError:
        full = None
    return views, full


def test_views_equal_the_loader():
    data = tensors.encode({**fragment_data(SPACES, 8), "empty": np.zeros((0, 3), np.float32),
                           "scalar": np.array(3.5, np.float64)})
    views, full = _both(data)
    assert views is not None and full is not None and views.keys() == full.keys()
    for k in full:
        assert views[k].dtype == full[k].dtype and views[k].shape == full[k].shape
        np.testing.assert_array_equal(views[k], full[k])


@pytest.mark.parametrize("seed", range(4))
def test_corrupted_payloads_are_never_accepted_by_views_alone(seed):
    rng = random.Random(seed)
    good = bytearray(tensors.encode(fragment_data(SPACES, 8)))
    for _ in range(150):
        bad = bytearray(good)
        how = rng.random()
        if how < 0.4:  # flip bytes in the header
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(min(len(bad), 400))
                bad[i] = rng.randrange(256)
        elif how < 0.7:
            bad = bad[: rng.randrange(len(bad))]  # truncate
        else:
            bad += bytes(rng.randrange(1, 16))  # trailing bytes
        views, full = _both(bytes(bad))
        if views is not None:
            assert full is not None and views.keys() == full.keys()
            for k in full:
                np.testing.assert_array_equal(views[k], full[k])


def test_wire_split_and_chunk_assembly():
    frag = common_pb2.Fragment(header=common_pb2.FragmentHeader(run_id="r", sequence=300), tensors=b"x" * 1000)
    raw = replay_buffer_pb2.InsertRequest(fragment=frag).SerializeToString()
    fields = wire.length_delimited_fields(memoryview(raw))
    inner = wire.length_delimited_fields(fields[1])
    assert common_pb2.FragmentHeader.FromString(inner[1]) == frag.header and bytes(inner[2]) == frag.tensors
    chunk = replay_buffer_pb2.SampledChunk.FromString(wire.sampled_chunk(2**40, [frag.SerializeToString()] * 2, 3))
    assert (chunk.chunk_id, list(chunk.fragments), chunk.times_sampled) == (2**40, [frag, frag], 3)
    with pytest.raises(wire.WireError):
        wire.length_delimited_fields(memoryview(b"\x08\x01"))  # a varint field: left to protobuf
    for v in (0, 1, 127, 128, 300, 2**32, 2**63 - 1):
        assert replay_buffer_pb2.SampledChunk.FromString(b"\x08" + wire.varint(v)).chunk_id == v
