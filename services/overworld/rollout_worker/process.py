"""`overworld serve rollout-worker`: the worker loop plus its gRPC service (the control surface: status,
drain) and its weights relay (model_registry/worker/relay.py: the versions it receives, passed on over the
weights stream to the workers the registry sends to it)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc

from overworld.core.grpc_util import Refused, Server, serve
from overworld.model_registry.worker.relay import RelayShelf, serve_relay
from overworld.rollout_worker.worker import RolloutWorker
from overworld.v1 import rollout_worker_pb2 as pb
from overworld.v1 import rollout_worker_pb2_grpc

log = logging.getLogger("overworld.rollout_worker")


# Told to stop, the loop finishes the fragments under way for up to FINISH_SECONDS, then stops within a
# step (LOOP_STOP_SECONDS); the rest of a pod's grace period (the chart's terminationGracePeriodSeconds
# less 20 s) goes to the flush.
FINISH_SECONDS = 8.0
LOOP_STOP_SECONDS = 10.0

class WorkerService(rollout_worker_pb2_grpc.RolloutWorkerServicer):
    """Serves before the worker is built: status calls answer UNAVAILABLE until then."""

    def __init__(self, drain: threading.Event) -> None:
        self.drain = drain
        self.worker: RolloutWorker | None = None

    def GetStatus(self, request: pb.GetWorkerStatusRequest, context: grpc.ServicerContext) -> pb.WorkerStatus:
        w = self.worker
        if w is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the worker is still starting")
        return pb.WorkerStatus(worker_id=w.worker_id, num_envs=w.N, env_steps=w.env_steps,
                               fragments_sent=w.sender.sent, fragments_dropped=w.fragments_dropped,
                               model_version=w.model_version, send_queue_depth=w.sender.depth(),
                               env_steps_per_second=w.steps_per_second, env_restarts=w.pool.restarts_snapshot())

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        self.drain.set()
        return pb.DrainResponse()


def add_to_server(service: WorkerService, server: Any) -> None:
    rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server(service, server)


class RolloutWorkerProcess:
    """Runs the worker loop in a thread; stop() flushes and deregisters."""

    def __init__(self, rollout_manager: str, replay_buffer: str, model_registry: str, host: str, port: int,
                 done: threading.Event, flush_timeout: float = 30.0, weights_port: int = 0) -> None:
        self.flush_timeout = flush_timeout
        shelf = RelayShelf()
        self.service = WorkerService(done)
        self.server: Server = serve([(add_to_server, self.service, "overworld.v1.RolloutWorker")], host, port)
        self.server.set_serving(False)  # the probes wait for the worker
        try:
            # the relay serves before the worker is built: the registry must know where it relays before the
            # first version arrives
            self.relay = serve_relay(shelf, host, weights_port)
        except BaseException:
            self.server.stop(0)
            raise
        try:
            self.worker = RolloutWorker(rollout_manager, replay_buffer, model_registry,
                                        address=f"{host}:{self.server.port}", relay_port=self.relay.port, shelf=shelf)
        except BaseException:
            self.relay.stop()
            self.server.stop(0)
            raise
        self.service.worker = self.worker
        self.server.set_serving(True)
        self.failed = False
        self._thread = threading.Thread(target=self._run, args=(done,), name="rollout-loop", daemon=True)
        self._thread.start()

    def _run(self, done: threading.Event) -> None:
        try:
            self.worker.run()
        except Exception:
            self.failed = True
            log.exception("rollout loop failed")
        finally:
            done.set()

    def stop(self, grace: float = 5.0) -> None:
        self.worker.finish(FINISH_SECONDS)
        self._thread.join(FINISH_SECONDS + 1.0)
        self.worker.stop_event.set()
        self._thread.join(LOOP_STOP_SECONDS)
        self.worker.shutdown(self.flush_timeout)
        self.relay.stop()
        self.server.stop(grace)
