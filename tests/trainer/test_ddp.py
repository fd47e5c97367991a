"""DDP on Ray Train (gloo, 2 CPU workers): the same update as one worker on the doubled batch, and a
NaN on one rank skips the step on every rank. One Ray session for the module."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray.cloudpickle
import torch

from tests.trainer import helpers

# Ray workers cannot import this test tree (site-packages has its own `tests`): ship it by value.
ray.cloudpickle.register_pickle_by_value(helpers)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROOT = Path(__file__).resolve().parents[2]
BASE = ["train_config.epochs_per_iteration=1", "train_config.batches_per_iteration=1",
        "train_config.context_length=8", "train_config.num_gpus_per_worker=0"]
B = 8


def train_once(config: dict) -> None:
    import ray.train
    import torch

    flat_params, make_batch, make_trainer = helpers.flat_params, helpers.make_batch, helpers.make_trainer
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    trainer = make_trainer(*config["overrides"], f"train_config.batch_size_per_gpu={B // world}",
                           world_size=world, rank=rank)
    batch = make_batch(trainer, B=B, L=16, seed=3)
    share = batch.select(slice(rank * (B // world), (rank + 1) * (B // world)))
    if config.get("nan_rank") == rank:
        share.advantage[0, 0] = float("nan")
    before = flat_params(trainer.unwrapped_model)
    metrics = trainer.train_iteration(share)
    torch.save({"before": before, "after": flat_params(trainer.unwrapped_model),
                "skipped": metrics["trainer/skipped_steps"], "updates": trainer.updates},
               Path(config["out"]) / f"world{world}-rank{rank}.pt")


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"RAY_worker_niceness": "0"}})
    yield
    ray.shutdown()


def fit(num_workers: int, out: Path, **config: object) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(train_once, train_loop_config={"out": str(out), **config},
                 scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=False),
                 run_config=RunConfig(storage_path=str(out / "ray"))).fit()


def load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.slow
def test_two_workers_make_the_same_update_as_one_on_the_doubled_batch(ray_session, tmp_path: Path) -> None:
    fit(1, tmp_path, overrides=BASE)
    fit(2, tmp_path, overrides=BASE)
    single, r0, r1 = load(tmp_path, "world1-rank0"), load(tmp_path, "world2-rank0"), load(tmp_path, "world2-rank1")
    assert torch.equal(single["before"], r0["before"])
    assert not torch.allclose(single["before"], single["after"])
    torch.testing.assert_close(r0["after"], r1["after"], rtol=0, atol=0)
    torch.testing.assert_close(r0["after"], single["after"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_nan_on_one_rank_skips_the_step_on_every_rank(ray_session, tmp_path: Path) -> None:
    fit(2, tmp_path, overrides=[*BASE, "train_config.normalize_advantage_full_batch=false"], nan_rank=1)
    for rank in (0, 1):
        result = load(tmp_path, f"world2-rank{rank}")
        assert result["skipped"] == 1 and result["updates"] == 0
        assert torch.equal(result["before"], result["after"])
