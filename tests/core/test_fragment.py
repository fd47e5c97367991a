import numpy as np
import pytest

from overworld.core.specs import Spaces, TensorSpec
from overworld.core.wire import tensors
from overworld.core.wire.fragment import Fragment, FragmentError, validate
from overworld.v1 import common_pb2

SPACES = Spaces(obs={"image": TensorSpec((4, 4, 3), "uint8"), "vector": TensorSpec((2,), "float32")},
                action={"action": TensorSpec((), "int64")}, state={"h": TensorSpec((8,), "float32")})
T = 5


def make_fragment(**overrides: np.ndarray) -> Fragment:
    rng = np.random.default_rng(0)
    data = {
        "obs.image": rng.integers(0, 255, (T, 4, 4, 3), dtype=np.uint8),
        "obs.vector": rng.normal(size=(T, 2)).astype(np.float32),
        "next_obs.image": rng.integers(0, 255, (1, 4, 4, 3), dtype=np.uint8),
        "next_obs.vector": rng.normal(size=(1, 2)).astype(np.float32),
        "action.action": rng.integers(0, 3, T).astype(np.int64),
        "state.h": np.zeros(8, np.float32),
        "reward": rng.normal(size=T).astype(np.float32),
        "terminated": np.zeros(T, bool), "truncated": np.zeros(T, bool), "first": np.eye(1, T, dtype=bool)[0],
        "logp": np.full(T, -1.1, np.float32), "value": np.zeros(T, np.float32),
        "bootstrap_value": np.zeros(T, np.float32), "model_version": np.array([3, 3, 4, 4, 4], np.int64),
    }
    data.update(overrides)
    return Fragment("run", "w-1", 2, 7, data)


@pytest.mark.parametrize("compression", [common_pb2.COMPRESSION_NONE, common_pb2.COMPRESSION_ZLIB])
def test_roundtrip(compression: int) -> None:
    fragment = make_fragment()
    msg = fragment.to_proto(compression)
    assert msg.header.first_model_version == 3 and msg.header.length == T
    back = Fragment.from_proto(common_pb2.Fragment.FromString(msg.SerializeToString()))
    assert (back.run_id, back.worker_id, back.env_slot, back.sequence) == ("run", "w-1", 2, 7)
    for key, value in fragment.data.items():
        np.testing.assert_array_equal(back.data[key], value)
    validate(back, SPACES, T, "run")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"obs.image": np.zeros((T, 4, 4, 4), np.uint8)}, "obs.image: shape"),
    ({"obs.vector": np.zeros((T, 2), np.float64)}, "obs.vector: dtype"),
    ({"reward": np.array([0, np.nan, 0, 0, 0], np.float32)}, "reward: contains NaN"),
    ({"obs.vector": np.full((T, 2), np.inf, np.float32)}, "obs.vector: contains NaN or infinity"),
    ({"model_version": np.array([4, 3, 3, 3, 3], np.int64)}, "non-decreasing"),
    ({"extra": np.zeros(T, np.float32)}, "unexpected tensors: extra"),
])
def test_validation_names_the_problem(overrides: dict, message: str) -> None:
    with pytest.raises(FragmentError, match=message):
        validate(make_fragment(**overrides), SPACES, T, "run")


def test_missing_tensor_and_wrong_run() -> None:
    fragment = make_fragment()
    del fragment.data["logp"]
    with pytest.raises(FragmentError, match="missing tensors: logp"):
        validate(fragment, SPACES, T)
    with pytest.raises(FragmentError, match="belongs to run"):
        validate(make_fragment(), SPACES, T, "other-run")


def test_garbage_bytes_are_a_decode_error_not_a_crash() -> None:
    with pytest.raises(tensors.TensorDecodeError):
        tensors.decode(b"\x00\x01garbage")
    bomb = tensors.encode({"x": np.zeros(10_000_000, np.uint8)}, common_pb2.COMPRESSION_ZLIB)
    with pytest.raises(tensors.TensorDecodeError, match="exceed"):
        tensors.decode(bomb, common_pb2.COMPRESSION_ZLIB, max_bytes=1_000_000)


def test_spaces_proto_roundtrip() -> None:
    assert Spaces.from_proto(SPACES.to_proto()) == SPACES
