"""DDP on Ray Train, 2 gloo ranks: every policy the project ships, a user policy with an unused head,
the value warm-up with rho = 0 and fix_decoder train without hanging or crashing; 2 ranks make the
same update as one rank on the doubled batch, with gradient accumulation too (and the all-reduce runs
on the last micro-step only); a NaN on one rank skips the step on every rank; each rank's RNG state
comes back from a checkpoint.

One Ray session and one Ray Train run for the module: the cases run one after the other in the same
two workers, each writes what it saw, and each test checks one case. A collective that hangs fails
after TorchConfig.timeout_s instead of blocking the suite."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import ray.cloudpickle
import torch

from overworld.policies.base import Policy
from overworld.policies.nets import make_cnn_policy
from overworld.trainer.learner import PPOLearner
from tests.trainer import helpers

# Ray workers cannot import this test tree (site-packages has its own `tests`): ship it by value.
ray.cloudpickle.register_pickle_by_value(helpers)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.slow

B = 8  # chains in the whole batch
L = 16  # steps per chain: two windows of 8
BASE = ["train_config.epochs_per_iteration=1", "train_config.context_length=8", "train_config.num_gpus_per_worker=0"]
IMAGE = (16, 16, 3)


class CNNTrainer(PPOLearner):
    """The project's recurrent CNN policy (Crafter's), on small images."""

    def build_policy(self) -> Policy:
        return make_cnn_policy(gym.spaces.Box(0, 255, IMAGE, np.uint8), gym.spaces.Discrete(2), key="obs",
                               channels=[8, 8], hidden=32, recurrent=True)


class UnusedHeadTrainer(PPOLearner):
    """A user's policy with a head its forward never calls."""

    def build_policy(self) -> Policy:
        policy = super().build_policy()
        policy.auxiliary_head = torch.nn.Linear(64, 5)
        return policy


def share(batch: Any, rank: int, world: int) -> Any:
    n = batch.size // world
    return batch.select(slice(rank * n, (rank + 1) * n))


def two_iterations(rank: int, world: int, *overrides: str, cls: type = PPOLearner,
                   image: bool = False) -> dict[str, Any]:
    """Two iterations of 2 optimizer steps each on this rank's half of the batch."""
    trainer = helpers.make_trainer(*BASE, "train_config.batches_per_iteration=2",
                                   "train_config.gradient_accumulation=1", f"train_config.batch_size_per_gpu={B // 4}",
                                   *overrides, world_size=world, rank=rank, cls=cls)
    kwargs = {"obs_shape": IMAGE, "obs_dtype": torch.uint8} if image else {}
    policy = trainer.unwrapped_model
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    for seed in (1, 2):
        trainer.iteration += 1
        trainer.train_iteration(share(helpers.make_batch(trainer, B=B, L=L, seed=seed, **kwargs), rank, world))
    changed = {n: not torch.equal(before[n], p.detach()) for n, p in policy.named_parameters()}
    return {"updates": trainer.updates, "params": helpers.flat_params(policy), "changed": changed}


def doubled_batch(rank: int, world: int) -> dict[str, Any]:
    over = ["train_config.batches_per_iteration=1", "train_config.gradient_accumulation=1"]
    trainer = helpers.make_trainer(*BASE, *over, f"train_config.batch_size_per_gpu={B // world}",
                                   world_size=world, rank=rank)
    batch = helpers.make_batch(trainer, B=B, L=L, seed=3)
    out = {"before": helpers.flat_params(trainer.unwrapped_model)}
    trainer.train_iteration(share(batch, rank, world))
    out["after"] = helpers.flat_params(trainer.unwrapped_model)
    if rank == 0:  # the same update by one rank, on the whole batch, without DDP
        single = helpers.make_trainer(*BASE, *over, f"train_config.batch_size_per_gpu={B}")
        single.train_iteration(helpers.make_batch(single, B=B, L=L, seed=3))
        out["single"] = helpers.flat_params(single.unwrapped_model)
    return out


def accumulation(rank: int, world: int) -> dict[str, Any]:
    """2 ranks x 2 micro-steps of B/4 chains, 2 windows each = one step of one rank on B chains."""
    trainer = helpers.make_trainer(*BASE, "train_config.batches_per_iteration=2", "train_config.gradient_accumulation=2",
                                   f"train_config.batch_size_per_gpu={B // 4}", world_size=world, rank=rank)
    backward_passes: list[int] = []
    synced_at: list[int] = []
    trainer.hooks.register("post_loss", lambda t, terms: backward_passes.append(1))

    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # (DDP rejects other annotations)
        synced_at.append(len(backward_passes))  # the backward pass this all-reduce belongs to
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(None, bucket)  # type: ignore[arg-type]

    trainer.model.register_comm_hook(None, counting_allreduce)
    batch = helpers.make_batch(trainer, B=B, L=L, seed=4)
    trainer.train_iteration(share(batch, rank, world))
    out = {"after": helpers.flat_params(trainer.unwrapped_model), "updates": trainer.updates,
           "backward_passes": len(backward_passes), "synced_at": sorted(set(synced_at))}
    if rank == 0:
        single = helpers.make_trainer(*BASE, "train_config.batches_per_iteration=1",
                                      "train_config.gradient_accumulation=1", f"train_config.batch_size_per_gpu={B}")
        single.train_iteration(helpers.make_batch(single, B=B, L=L, seed=4))
        out["single"] = helpers.flat_params(single.unwrapped_model)
    return out


def nan_on_rank_1(rank: int, world: int) -> dict[str, Any]:
    trainer = helpers.make_trainer(*BASE, "train_config.batches_per_iteration=1",
                                   "train_config.gradient_accumulation=1", "train_config.normalize_advantage_full_batch=false",
                                   f"train_config.batch_size_per_gpu={B // world}", world_size=world, rank=rank)
    part = share(helpers.make_batch(trainer, B=B, L=L, seed=3), rank, world)
    if rank == 1:
        part.advantage[0, 0] = float("nan")
    before = helpers.flat_params(trainer.unwrapped_model)
    metrics = trainer.train_iteration(part)
    return {"before": before, "after": helpers.flat_params(trainer.unwrapped_model),
            "skipped": metrics["trainer/skipped_steps"], "updates": trainer.updates}


def rng_per_rank(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    from overworld.core.blobs.store import LocalBlobStore
    from overworld.trainer.checkpoint import CheckpointStore

    trainer = helpers.make_trainer(*BASE, world_size=world, rank=rank)
    trainer.checkpoints = CheckpointStore(LocalBlobStore(out_dir / "checkpoints"))
    torch.manual_seed(1000 + rank)
    torch.rand(7)
    trainer.iteration = 3
    trainer.save_checkpoint()  # every rank calls it; rank 0 writes
    saved = torch.get_rng_state()
    expected_draw = torch.rand(5)
    torch.distributed.barrier()  # rank 0 has written it
    torch.manual_seed(0)  # a fresh process: the same seed on every rank
    fresh = helpers.make_trainer(*BASE, "train_config.resume=latest", world_size=world, rank=rank)
    fresh.checkpoints = trainer.checkpoints
    fresh.restore()
    return {"saved": saved, "restored": torch.get_rng_state(), "draw": torch.rand(5), "expected_draw": expected_draw,
            "iteration": fresh.iteration}


def deadline_on_rank_1(rank: int, world: int) -> dict[str, Any]:
    """Only rank 1 has heard of the stop's deadline (each rank asks the driver on its own)."""
    import time

    from overworld.trainer.stopping import STOP_MARGIN_SECONDS

    trainer = helpers.make_trainer(*BASE, "train_config.epochs_per_iteration=100000",
                                   f"train_config.batch_size_per_gpu={B // world}", world_size=world, rank=rank)
    part = share(helpers.make_batch(trainer, B=B, L=L, seed=5), rank, world)
    if rank == 1:
        trainer.stop_deadline.checkpoint_seconds = 0.5
        trainer.stop_deadline.at = time.monotonic() + STOP_MARGIN_SECONDS + 3.0
    trainer.train_iteration(part)
    return {"updates": trainer.updates, "cut_short": trainer.cut_short,
            "params": helpers.flat_params(trainer.unwrapped_model)}


CASES: dict[str, Callable[[int, int, Path], dict[str, Any]]] = {
    "doubled_batch": lambda r, w, d: doubled_batch(r, w),
    "accumulation": lambda r, w, d: accumulation(r, w),
    "nan_on_rank_1": lambda r, w, d: nan_on_rank_1(r, w),
    "recurrent_mlp": lambda r, w, d: two_iterations(r, w, "policy_kwargs.recurrent=true"),
    "recurrent_cnn": lambda r, w, d: two_iterations(r, w, cls=CNNTrainer, image=True),
    "vf_warmup_rho_0": lambda r, w, d: two_iterations(r, w, "train_config.vf_warmup=5",
                                                      "train_config.kl_divergence_coef_rho=0.0"),
    "fix_decoder": lambda r, w, d: two_iterations(r, w, "train_config.fix_decoder=true",
                                                  "policy_kwargs.recurrent=true"),
    "unused_head": lambda r, w, d: two_iterations(r, w, cls=UnusedHeadTrainer),
    "rng_per_rank": rng_per_rank,
    "deadline_on_rank_1": lambda r, w, d: deadline_on_rank_1(r, w),
}


def run_cases(config: dict) -> None:
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    out_dir = Path(config["out"])
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        try:
            results[name] = case(rank, world, out_dir)
        except Exception:  # recorded, and the test of that case fails with it; the other cases go on
            results[name] = {"error": traceback.format_exc()}
            raise  # a rank that failed a collective leaves the group unusable: stop here
        finally:
            torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = tmp_path_factory.mktemp("ddp")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"RAY_worker_niceness": "0"}})
    try:
        try:
            TorchTrainer(run_cases, train_loop_config={"out": str(out)}, torch_config=TorchConfig(timeout_s=180),
                         scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                         run_config=RunConfig(storage_path=str(out / "ray"))).fit()
        except Exception as err:  # each test reports the case that failed
            print(f"Ray Train run failed: {err}")
        yield [torch.load(out / f"rank{r}.pt", weights_only=False) if (out / f"rank{r}.pt").exists() else {}
               for r in (0, 1)]
    finally:
        ray.shutdown()


def case(ranks: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    r0, r1 = (r.get(name, {"error": "not reached (an earlier case failed)"}) for r in ranks)
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    return r0, r1


def test_two_ranks_make_the_same_update_as_one_on_the_doubled_batch(ranks) -> None:
    r0, r1 = case(ranks, "doubled_batch")
    assert torch.equal(r0["before"], r1["before"]) and not torch.allclose(r0["before"], r0["after"])
    torch.testing.assert_close(r0["after"], r1["after"], rtol=0, atol=0)
    torch.testing.assert_close(r0["after"], r0["single"], rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_is_one_big_step_and_all_reduces_once(ranks) -> None:
    r0, r1 = case(ranks, "accumulation")
    assert r0["updates"] == r1["updates"] == 1
    torch.testing.assert_close(r0["after"], r1["after"], rtol=0, atol=0)
    torch.testing.assert_close(r0["after"], r0["single"], rtol=1e-5, atol=1e-6)
    # 2 micro-steps x 2 windows = 4 backward passes; only the 4th (the last window of the last
    # micro-step) all-reduces, the others run under no_sync
    assert r0["backward_passes"] == r1["backward_passes"] == 4
    assert r0["synced_at"] == r1["synced_at"] == [4]


def test_a_deadline_one_rank_heard_of_cuts_every_ranks_update_at_the_same_step(ranks) -> None:
    r0, r1 = case(ranks, "deadline_on_rank_1")
    assert r0["cut_short"] and r1["cut_short"]
    assert 0 < r0["updates"] == r1["updates"] < 100000
    assert torch.equal(r0["params"], r1["params"])  # the same steps, all-reduced: the same weights


def test_nan_on_one_rank_skips_the_step_on_every_rank(ranks) -> None:
    for result in case(ranks, "nan_on_rank_1"):
        assert result["skipped"] == 1 and result["updates"] == 0
        assert torch.equal(result["before"], result["after"])


def trained_in_step(ranks: list[dict[str, Any]], name: str) -> dict[str, bool]:
    r0, r1 = case(ranks, name)
    assert r0["updates"] == r1["updates"] == 4
    torch.testing.assert_close(r0["params"], r1["params"], rtol=0, atol=0)  # the ranks never diverge
    return r0["changed"]


def test_recurrent_mlp_trains_on_two_ranks(ranks) -> None:
    changed = trained_in_step(ranks, "recurrent_mlp")
    assert changed["core.cell.weight_ih"] and changed["policy_head.action.weight"]
    assert not changed["value_encoder.0.weight"]  # the recurrent MLP never calls it: no gradient, no hang


def test_recurrent_cnn_trains_on_two_ranks(ranks) -> None:
    changed = trained_in_step(ranks, "recurrent_cnn")
    assert all(changed.values())


def test_value_warmup_with_rho_0_trains_on_two_ranks(ranks) -> None:
    changed = trained_in_step(ranks, "vf_warmup_rho_0")
    assert changed["value_head.weight"] and changed["value_encoder.0.weight"]
    assert not changed["policy_head.action.weight"] and not changed["encoder.0.weight"]


def test_fix_decoder_trains_on_two_ranks(ranks) -> None:
    changed = trained_in_step(ranks, "fix_decoder")
    assert not changed["policy_head.action.weight"] and not changed["core.cell.weight_ih"]
    assert changed["encoder.0.weight"] and changed["value_head.weight"]


def test_a_policy_with_an_unused_head_trains_on_two_ranks(ranks) -> None:
    changed = trained_in_step(ranks, "unused_head")
    assert not changed["auxiliary_head.weight"] and changed["policy_head.action.weight"]


def test_each_rank_gets_its_own_rng_state_back_from_a_checkpoint(ranks) -> None:
    r0, r1 = case(ranks, "rng_per_rank")
    assert not torch.equal(r0["saved"], r1["saved"])
    for r in (r0, r1):
        assert r["iteration"] == 3
        assert torch.equal(r["restored"], r["saved"]) and torch.equal(r["draw"], r["expected_draw"])
