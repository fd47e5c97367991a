"""`overworld serve rollout-worker`: the worker loop plus its gRPC control surface."""

from __future__ import annotations

import logging
import threading

from overworld.core.grpc_util import Server, serve
from overworld.rollout_worker.worker import RolloutWorker
from overworld.v1 import rollout_worker_pb2 as pb
from overworld.v1 import rollout_worker_pb2_grpc

log = logging.getLogger("overworld.rollout_worker")


class ControlService(rollout_worker_pb2_grpc.RolloutWorkerServicer):
    def __init__(self, worker: RolloutWorker, drain: threading.Event) -> None:
        self.worker = worker
        self.drain = drain

    def GetStatus(self, request, context):  # type: ignore[no-untyped-def]
        w = self.worker
        return pb.WorkerStatus(worker_id=w.worker_id, num_envs=w.N, env_steps=w.env_steps,
                               fragments_sent=w.sender.sent, fragments_dropped=w.fragments_dropped,
                               model_version=w.model_version, send_queue_depth=w.sender.depth(),
                               env_steps_per_second=w.steps_per_second, env_restarts=w.pool.restarts_snapshot())

    def Drain(self, request, context):  # type: ignore[no-untyped-def]
        self.drain.set()
        return pb.DrainResponse()


class RolloutWorkerProcess:
    """Runs the worker loop in a thread; stop() flushes and deregisters."""

    def __init__(self, rollout_manager: str, replay_buffer: str, model_registry: str, host: str, port: int,
                 done: threading.Event, flush_timeout: float = 30.0) -> None:
        self.flush_timeout = flush_timeout
        self.worker = RolloutWorker(rollout_manager, replay_buffer, model_registry, address=f"{host}:{port}")
        self.server: Server = serve([(rollout_worker_pb2_grpc.add_RolloutWorkerServicer_to_server,
                                      ControlService(self.worker, done), "overworld.v1.RolloutWorker")], host, port)
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
