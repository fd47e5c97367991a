"""`overworld serve rollout-worker`: the worker loop plus its gRPC service: the control surface
(status, drain) and the weights relay (FetchWeights: the versions it receives, passed on to the
workers the registry sends to it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import grpc

from overworld.core.grpc_util import Server, abort, add_overriding, serve
from overworld.model_registry.relay import RelayShelf, serve_relayed
from overworld.rollout_worker.worker import RolloutWorker
from overworld.v1 import model_registry_pb2, rollout_worker_pb2_grpc
from overworld.v1 import rollout_worker_pb2 as pb

log = logging.getLogger("overworld.rollout_worker")


class WorkerService(rollout_worker_pb2_grpc.RolloutWorkerServicer):
    """Serves before the worker is built (the registry must know where it relays before the first
    version arrives): status calls answer UNAVAILABLE until then."""

    def __init__(self, shelf: RelayShelf, drain: threading.Event) -> None:
        self.shelf = shelf
        self.drain = drain
        self.worker: RolloutWorker | None = None

    def GetStatus(self, request: pb.GetWorkerStatusRequest, context: grpc.ServicerContext) -> pb.WorkerStatus:
        w = self.worker
        if w is None:
            abort(context, grpc.StatusCode.UNAVAILABLE, "the worker is still starting")
        return pb.WorkerStatus(worker_id=w.worker_id, num_envs=w.N, env_steps=w.env_steps,
                               fragments_sent=w.sender.sent, fragments_dropped=w.fragments_dropped,
                               model_version=w.model_version, send_queue_depth=w.sender.depth(),
                               env_steps_per_second=w.steps_per_second, env_restarts=w.pool.restarts_snapshot())

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        self.drain.set()
        return pb.DrainResponse()

    def fetch_weights(self, request: model_registry_pb2.FetchRequest, context: grpc.ServicerContext
                      ) -> Iterable[bytes]:
        return serve_relayed(self.shelf, request, context)


def _identity(message: bytes) -> bytes:
    return message


def add_to_server(service: WorkerService, server: Any) -> None:
    """The generated registration, but FetchWeights sends the messages as received (no re-encoding)."""
    add_overriding(rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server, service, server,
                   "overworld.v1.RolloutWorker", {
                       "FetchWeights": grpc.unary_stream_rpc_method_handler(
                           service.fetch_weights, request_deserializer=model_registry_pb2.FetchRequest.FromString,
                           response_serializer=_identity)})


class RolloutWorkerProcess:
    """Runs the worker loop in a thread; stop() flushes and deregisters."""

    def __init__(self, rollout_manager: str, replay_buffer: str, model_registry: str, host: str, port: int,
                 done: threading.Event, flush_timeout: float = 30.0) -> None:
        self.flush_timeout = flush_timeout
        shelf = RelayShelf()
        self.service = WorkerService(shelf, done)
        self.server: Server = serve([(add_to_server, self.service, "overworld.v1.RolloutWorker")], host, port)
        self.server.set_serving(False)  # the probes wait for the worker; the relay serves at once
        try:
            self.worker = RolloutWorker(rollout_manager, replay_buffer, model_registry,
                                        address=f"{host}:{self.server.port}", relay_port=self.server.port, shelf=shelf)
        except BaseException:
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
        self.worker.stop_event.set()
        self._thread.join(30)
        self.worker.shutdown(self.flush_timeout)
        self.server.stop(grace)
