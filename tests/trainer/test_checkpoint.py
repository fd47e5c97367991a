from pathlib import Path

import pytest

from overworld.core.blobs.store import LocalBlobStore
from overworld.trainer.checkpoint import CheckpointStore, checkpoint_id


def test_keep_interval_keeps_exactly_every_kth_and_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(LocalBlobStore(tmp_path))
    for iteration in range(10, 101, 10):  # save_interval 10
        ckpt = store.save(iteration, {"iteration": iteration}, {"model.safetensors": b"m"})
        store.prune(keep_interval=40, newest=ckpt)
    assert store.list() == [checkpoint_id(40), checkpoint_id(80), checkpoint_id(100)]
    store.save(110, {"iteration": 110}, {"model.safetensors": b"m"})
    store.prune(40, checkpoint_id(110))
    assert store.list() == [checkpoint_id(40), checkpoint_id(80), checkpoint_id(110)]


def test_half_written_checkpoint_is_never_listed(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path)
    store = CheckpointStore(blobs)
    store.save(5, {"iteration": 5}, {"model.safetensors": b"good"})
    blobs.put("checkpoints/iter-00000010/model.safetensors", b"half")  # crashed before COMMITTED
    assert store.list() == [checkpoint_id(5)]
    assert store.resolve("latest") == checkpoint_id(5)
    loaded = store.load(checkpoint_id(5), ["model.safetensors", "optimizer.pt"])
    assert loaded.files == {"model.safetensors": b"good"} and loaded.state["iteration"] == 5


def test_resolve_names_what_exists(tmp_path: Path) -> None:
    store = CheckpointStore(LocalBlobStore(tmp_path))
    assert store.resolve("latest") is None
    store.save(3, {}, {})
    with pytest.raises(ValueError, match="iter-00000003"):
        store.resolve("iter-00000007")
