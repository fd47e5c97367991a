"""The hook points inside the algorithm (trainer/hooks.py): each runs where it says, with its context,
declared on the learner's method it surrounds (the algorithm's body calls no hook), and once per
iteration on MineStudio's path too."""

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from overworld.core.grpc_util import Server, serve, wait_healthy
from overworld.gae.client import GaeClient
from overworld.gae.server import GaeService
from overworld.online.trainer import PPOTrainer
from overworld.trainer.hooks import POINTS, around
from overworld.trainer.learner import PPOLearner
from overworld.v1 import gae_pb2_grpc
from tests.trainer.helpers import make_batch, make_trainer

LEARNER = Path(__file__).resolve().parents[2] / "services" / "overworld" / "trainer" / "learner.py"
# 2 minibatches of 4 chains, 16 steps in 2 windows of 8: each minibatch 2 losses, then a step
BASE = ("train_config.batch_size_per_gpu=4", "train_config.batches_per_iteration=2",
        "train_config.context_length=8", "train_config.epochs_per_iteration=1")


def record(trainer: PPOLearner) -> list[tuple[str, dict[str, Any]]]:
    seen: list[tuple[str, dict[str, Any]]] = []
    for point in POINTS:
        trainer.hooks.register(point, lambda t, _point=point, **context: seen.append((_point, context)))
    return seen


@pytest.fixture(scope="module")
def gae() -> Iterator[Server]:
    server = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
    wait_healthy(server.address, service="overworld.v1.Gae")
    yield server
    server.stop(0)


def test_the_update_runs_its_points_in_order_with_their_context() -> None:
    trainer = make_trainer(*BASE, "train_config.epochs_per_iteration=2")
    seen = record(trainer)
    trainer.train_iteration(make_batch(trainer, B=8, L=16))
    minibatch = ["post_loss", "post_loss", "pre_optim_step", "post_optim_step"]
    assert [point for point, _ in seen] == (minibatch * 2 + ["post_epoch"]) * 2
    assert [c["epoch"] for p, c in seen if p == "post_epoch"] == [0, 1]
    assert all(c == {"skipped": False} for p, c in seen if p == "post_optim_step")
    assert all(c == {} for p, c in seen if p == "pre_optim_step")
    losses = [c["terms"] for p, c in seen if p == "post_loss"]
    assert len(losses) == 8 and all(t.total_loss.requires_grad for t in losses)  # before their backward


def test_pre_optim_step_sees_the_gradients_before_clipping() -> None:
    trainer = make_trainer(*BASE, "train_config.max_grad_norm=0.000001")
    norms: list[float] = []
    trainer.hooks.register("pre_optim_step", lambda t: norms.append(float(torch.nn.utils.get_total_norm(
        [p.grad for p in t.model.parameters() if p.grad is not None]))))
    trainer.train_iteration(make_batch(trainer, B=8, L=16))
    assert len(norms) == 2 and min(norms) > 1e-3


def test_a_skipped_step_is_said_to_the_post_optim_step_hooks() -> None:
    trainer = make_trainer(*BASE, "train_config.normalize_advantage_full_batch=false")
    seen = record(trainer)
    batch = make_batch(trainer, B=8, L=16)
    batch.advantage[:] = float("nan")
    trainer.train_iteration(batch)
    assert [c for p, c in seen if p == "post_optim_step"] == [{"skipped": True}] * 2
    assert trainer.updates == 0


@pytest.mark.parametrize("cls", [PPOLearner, PPOTrainer])
def test_post_collect_runs_once_per_iteration_with_the_advantages_set(gae: Server, cls: type[PPOLearner]) -> None:
    trainer = make_trainer(*BASE, cls=cls)
    trainer.gae_client = GaeClient(gae.address)
    batch = make_batch(trainer, B=8, L=16)
    batch.advantage = batch.value_target = batch.old_vpred = None
    trainer.sample = lambda: batch  # type: ignore[method-assign]  # the replay buffer is not what is tested
    seen = record(trainer)
    trainer.train_iteration()
    collected = [c["batch"] for p, c in seen if p == "post_collect"]
    assert len(collected) == 1 and collected[0] is batch and batch.advantage is not None
    assert [p for p, _ in seen].index("post_collect") < [p for p, _ in seen].index("post_loss")
    trainer.gae_client.close()


def hook_uses(source: str) -> list[str]:
    """Where `source` reaches its hooks other than by declaring a point with @around: any use of a `hooks`
    attribute or of a name from trainer/hooks.py but `Hooks` (the annotation) and `around`."""
    tree = ast.parse(source)
    from_hooks = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.module == "overworld.trainer.hooks" for alias in node.names} - {"Hooks", "around"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "hooks" and not isinstance(node.ctx, ast.Store):
            found.append(f"line {node.lineno}: .hooks")
        elif isinstance(node, ast.Name) and node.id in from_hooks:
            found.append(f"line {node.lineno}: {node.id}")
    return found


def test_the_hook_check_finds_a_hook_run_by_the_algorithm() -> None:
    assert hook_uses("def step(self):\n    self.hooks.run('post_loss', self)\n")
    assert hook_uses("def step(self):\n    run = getattr(self.hooks, 'run')\n")
    assert hook_uses("from overworld.trainer.hooks import run_point\ndef step(self):\n    run_point(self)\n")
    assert not hook_uses("from overworld.trainer.hooks import Hooks, around\nclass L:\n    hooks: Hooks\n"
                         "    @around('post_loss')\n    def loss(self):\n        pass\n")


def test_the_algorithm_calls_no_hook_itself() -> None:
    assert not hook_uses(LEARNER.read_text()), "the learner runs hooks itself: declare the point with @around"


def test_a_point_is_checked_where_it_is_declared() -> None:
    with pytest.raises(ValueError, match="unknown hook point 'post_lunch'"):
        around("post_lunch")
    with pytest.raises(TypeError, match="no argument epoch"):
        around("post_epoch", arguments=("epoch",))(lambda self: None)
