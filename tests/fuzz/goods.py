"""Good data for each service, sent after hostile input: the service must still do its job."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from overworld.core.client import ServiceClient
from overworld.core.security import tls
from overworld.core.wire import weights
from overworld.core.wire.fragment import Fragment, expected_tensors
from overworld.gae.client import GaeClient
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_worker.client import RolloutWorkerClient
from overworld.trainer.client import TrainerClient
from overworld.v1 import replay_buffer_pb2, rollout_manager_pb2, trainer_pb2
from tests.security.services_in_one_process import Fleet

C = TypeVar("C", bound=ServiceClient)


def _as(fleet: Fleet, identity: str, client: type[C], service: str) -> C:
    """A client of `service`, with the credentials of `identity`."""
    assert fleet.credentials is not None
    tls.use(fleet.credentials[identity])
    return client(fleet.addresses[service])


@functools.cache
def _run(address: str, tls_dir: str) -> tuple[Any, Any]:
    """The fleet's run config and spaces (asked once)."""
    from overworld.policies.factory import run_spaces

    tls.use(tls_dir)
    with RolloutManagerClient(address) as manager:
        config = manager.run_config(timeout=10)
    spaces, policy, _, _ = run_spaces(config)
    return config, (spaces, weights.to_bytes(policy.state_dict()))


def run_of(fleet: Fleet) -> tuple[Any, Any]:
    assert fleet.credentials is not None
    config, (spaces, _) = _run(fleet.addresses["rollout-manager"], str(fleet.credentials["rollout-worker"]))
    return config, spaces


def policy_weights(fleet: Fleet) -> bytes:
    """The run's policy's initial weights: what the fleet's real worker can swap in."""
    assert fleet.credentials is not None
    return _run(fleet.addresses["rollout-manager"], str(fleet.credentials["rollout-worker"]))[1][1]


def rollout_manager(fleet: Fleet) -> None:
    config, spaces = run_of(fleet)
    with _as(fleet, "rollout-worker", RolloutManagerClient, "rollout-manager") as manager:
        reply = manager.register(rollout_manager_pb2.RegisterRequest(hostname="fuzz", num_envs=1,
                                                                     spaces=spaces.to_proto()), timeout=10)
        assert reply.worker_id and reply.run_id == config.run_id
        assert manager.heartbeat(rollout_manager_pb2.HeartbeatRequest(worker_id=reply.worker_id),
                                 timeout=10).lease_valid
        manager.deregister(reply.worker_id, timeout=10)


def replay_buffer(fleet: Fleet) -> None:
    config, spaces = run_of(fleet)
    length = config.rollout_config.fragment_length
    data = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in expected_tensors(spaces, length).items()}
    fragment = Fragment(config.run_id, f"fuzz-{uuid.uuid4().hex[:8]}", 0, 0, data).to_proto()
    with _as(fleet, "rollout-worker", ReplayBufferClient, "replay-buffer") as buffer:
        # Fuzzed Reserve calls name workers that hold no lease: refused, they hold no room that this
        # insert would wait for (they once held it all for the reservation ttl, 60 s).
        (ack,) = buffer.insert(iter([replay_buffer_pb2.InsertRequest(fragment=fragment)]), timeout=30)
        assert ack.worker_id == fragment.header.worker_id and ack.sequence == 0


def gae(fleet: Fleet) -> None:
    B, T = 2, 4
    batch = {k: np.zeros((B, T), np.float32) for k in ("reward", "value", "bootstrap_value")}
    batch |= {k: np.zeros((B, T), np.bool_) for k in ("terminated", "truncated")}
    batch["next_value"] = np.zeros((B,), np.float32)
    batch["reward"][:, -1] = 1.0
    with _as(fleet, "trainer", GaeClient, "gae") as client:
        advantage, _ = client.estimate(batch, 0.9, 0.95, timeout=30)
    assert advantage.shape == (B, T) and advantage[0, -1] == 1.0


def model_registry(fleet: Fleet) -> None:
    from overworld.model_registry.client import ModelRegistryClient

    payload = policy_weights(fleet)
    assert fleet.credentials is not None
    tls.use(fleet.credentials["trainer"])
    trainer = ModelRegistryClient(fleet.addresses["model-registry"])
    try:
        version = max((v.version for v in trainer.list_versions()), default=0) + 1
        trainer.publish(version, payload, timeout=30)
    finally:
        trainer.close()
    tls.use(fleet.credentials["rollout-worker"])
    worker = ModelRegistryClient(fleet.addresses["model-registry"])
    try:
        info, data = worker.fetch(version, timeout=30)
        assert info.version == version and bytes(data) == payload
    finally:
        worker.close()


def trainer(fleet: Fleet) -> None:
    with _as(fleet, "trainer", TrainerClient, "trainer") as client:
        client.report(trainer_pb2.TrainerStatus(state="running", iteration=3), timeout=10)
    with _as(fleet, "operator", TrainerClient, "trainer") as client:
        status = client.status(timeout=10)
    assert status.state == "running" and status.iteration == 3


def rollout_worker(fleet: Fleet) -> None:
    with _as(fleet, "operator", RolloutWorkerClient, "rollout-worker") as client:
        status = client.status(timeout=10)
    assert status.worker_id and status.num_envs > 0


GOOD_DATA: dict[str, Callable[[Fleet], None]] = {
    "rollout-manager": rollout_manager, "replay-buffer": replay_buffer, "gae": gae,
    "model-registry": model_registry, "trainer": trainer, "rollout-worker": rollout_worker}
