"""When the run reached each step of its start, as unix times of this machine's clock: structured
figures for the summary, `<workdir>/status.json` and bench/bench_e2e.py's startup timeline, never read
out of a log's wording. Each is when the launcher first saw it (it polls every STARTUP_POLL_SECONDS
while one is missing), except the first version's publication: the registry's own record of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import grpc

from overworld.launch.supervisor import Child
from overworld.model_registry.client import ModelRegistryClient
from overworld.rollout_worker.client import RolloutWorkerClient

STARTUP_POLL_SECONDS = 0.25
# Answering its health check as SERVING, per service.
SERVICE_MILESTONES = {"rollout-manager": "rollout_manager_started", "model-registry": "model_registry_started",
                      "replay-buffer": "replay_buffer_started", "gae": "gae_started", "trainer": "trainer_started"}
STARTUP_MILESTONES = (
    *SERVICE_MILESTONES.values(),
    "worker_registered",  # the rollout-manager lists a worker
    "first_version_published",  # the registry stored this run's first version
    "first_version_swapped_in_at_workers",  # the first worker runs a published version
    "training_started",  # the trainer reports `running`: its Ray (if it uses one) is up, the learners start
    "first_update",  # the trainer reports optimizer steps (it does after each iteration)
)


class StartupMilestones:
    def __init__(self, since_unix: float, resumed: bool = False) -> None:
        self.since_unix = since_unix  # versions older than the run's start are a resumed run's, not its own
        self.resumed = resumed
        self.reached: dict[str, float] = {}
        self._updates_before: int | None = None if resumed else 0

    def missing(self) -> list[str]:
        return [name for name in STARTUP_MILESTONES if name not in self.reached]

    def note(self, name: str, at_unix: float) -> None:
        self.reached.setdefault(name, round(at_unix, 3))

    def observe_services(self, children: Iterable[Child]) -> None:
        for child in children:
            name = SERVICE_MILESTONES.get(child.name)
            if name and child.serving_unix is not None:
                self.note(name, child.serving_unix)

    def observe_run(self, fleet: Any, trainer: Any, now_unix: float) -> None:
        """From the fleet and the trainer's status, as just read."""
        if fleet.workers:
            self.note("worker_registered", now_unix)
        if trainer.state in ("running", "finished"):
            self.note("training_started", now_unix)
        if self._updates_before is None:  # a resumed trainer counts on from its checkpoint's updates
            self._updates_before = trainer.updates
        elif trainer.updates > self._updates_before:
            self.note("first_update", now_unix)

    def poll(self, registry: ModelRegistryClient, worker: RolloutWorkerClient | None,
             now_unix: float) -> None:
        """Ask the registry and the first worker for what is still missing (one short call each)."""
        with contextlib.suppress(grpc.RpcError):
            if "first_version_published" not in self.reached:
                own = [v.created_unix for v in registry.list_versions(timeout=1.0) if v.created_unix >= self.since_unix]
                if own:
                    self.note("first_version_published", min(own))
            if worker is not None and "first_version_swapped_in_at_workers" not in self.reached:
                status = worker.status(timeout=1.0)
                if status.model_version > 0:
                    self.note("first_version_swapped_in_at_workers", now_unix)
