"""The first version is published by the trainer's driver while Ray starts, and the learner, which
builds the same starting weights from the same seed, adopts it instead of publishing them again.
Real model-registry and replay-buffer servers on loopback; no Ray."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.config import load_config
from overworld.core.grpc_util import serve
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.server import ModelRegistryService, registration
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.replay_buffer.index import MemoryIndex
from overworld.replay_buffer.server import ReplayBufferService, add_to_server
from overworld.trainer.learner import PPOLearner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def services(tmp_path: Path) -> Iterator[dict[str, Any]]:
    registry = ModelRegistryService(LocalBlobStore(tmp_path / "registry"))
    registry_server = serve([registration(registry)])
    index = MemoryIndex(64, 1, 2, 1, None)
    buffer = ReplayBufferService(index, LocalBlobStore(tmp_path / "blobs"), "run", 32, 1, 64, lambda: None)
    buffer_server = serve([(add_to_server, buffer, "overworld.v1.ReplayBuffer")])
    buffer_client = ReplayBufferClient(buffer_server.address)
    yield {"registry": registry_server.address, "buffer": buffer_client,
           "workdir": str(tmp_path)}
    buffer_client.close()
    buffer.stop()
    buffer_server.stop(0)
    registry.stop()
    registry_server.stop(0)


def trainer(services: dict[str, Any], *overrides: str) -> PPOLearner:
    config = load_config(ROOT / "examples/cartpole.yaml", list(overrides))
    return PPOLearner.from_config(config, rollout_manager="", model_registry=services["registry"],
                                  workdir=services["workdir"])


def learner_starts(services: dict[str, Any], *overrides: str, nudge: bool = False) -> PPOLearner:
    """What `_train_func` does up to the first publish, on rank 0."""
    learner = trainer(services, *overrides)
    learner.registry = ModelRegistryClient(services["registry"])
    learner.buffer = services["buffer"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a Ray Train worker runs
    try:
        learner.model, learner.optimizer = learner.build_starting_model()
        learner.lr_schedule = learner.setup_lr_schedule(learner.optimizer)
    finally:
        torch.set_num_threads(threads)
    if nudge:
        with torch.no_grad():
            next(learner.model.parameters()).add_(1.0)
    learner.publish_initial_version()
    return learner


def test_the_driver_publishes_version_1_and_the_learner_adopts_it(services) -> None:
    # The driver runs with more threads than a learner (orthogonal init's QR rounds differently).
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        trainer(services, "train_config.kl_divergence_coef_rho=0.1").publish_first_version()
    finally:
        torch.set_num_threads(threads)
    client = ModelRegistryClient(services["registry"])
    (v1,) = client.list_versions()
    assert v1.version == 1 and "reference" in v1.tags

    learner = learner_starts(services, "train_config.kl_divergence_coef_rho=0.1")
    assert learner.model_version == 1
    assert [v.version for v in client.list_versions()] == [1]  # not published twice
    stats = services["buffer"].stats(timeout=5.0)
    assert stats.model_version == 1
    client.close()


def test_a_learner_with_other_starting_weights_publishes_them(services) -> None:
    trainer(services).publish_first_version()
    learner = learner_starts(services, nudge=True)
    assert learner.model_version == 2
    client = ModelRegistryClient(services["registry"])
    assert [v.version for v in client.list_versions()] == [1, 2]
    client.close()


def test_the_driver_publishes_nothing_when_the_registry_has_a_version(services) -> None:
    learner_starts(services, nudge=True)  # e.g. a restarted trainer: the registry has the learner's weights
    trainer(services).publish_first_version()
    client = ModelRegistryClient(services["registry"])
    assert [v.version for v in client.list_versions()] == [1]
    client.close()


def test_a_stop_asked_while_ray_train_started_ends_training_before_its_first_iteration(services) -> None:
    """The driver was told to stop (a drain, a kubectl resume) while Ray Train placed its workers: the
    learner's first report gets the stop, and it finishes without waiting for the fleet or a batch."""
    from overworld.trainer.checkpoint import checkpoint_store
    from overworld.trainer.client import TrainerClient
    from overworld.trainer.driver import TrainerStatusService
    from overworld.v1 import trainer_pb2_grpc

    status = TrainerStatusService()
    status.stop_requested.set()
    server = serve([(trainer_pb2_grpc.add_TrainerServicer_to_server, status, "overworld.v1.Trainer")])
    status_client = TrainerClient(server.address)
    try:
        learner = learner_starts(services)
        learner._status = status_client
        learner.checkpoints = checkpoint_store(learner.config, learner.workdir)
        learner.train()  # no reader, no rollout manager: an iteration would fail
        assert learner.iteration == 0 and learner.updates == 0
        assert status.training_loop_started.is_set() and status.status.state == "finished"
    finally:
        status_client.close()
        server.stop(0)
