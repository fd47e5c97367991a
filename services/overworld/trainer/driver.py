"""`overworld serve trainer`: the driver. Starts (or joins) Ray, runs the trainer's `fit()`, and
serves the trainer status that rank 0 reports after every iteration. With `train_config.num_workers: 0`
the learner runs in this process (as in Ray Train's local mode) and Ray is neither started nor imported:
a machine without Ray trains (tests/trainer/test_local_mode_without_ray.py)."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
from typing import Any

import grpc
from prometheus_client import Counter, Gauge

from overworld.core.config import RunConfig, load_config
from overworld.core.config_files import ConfigError
from overworld.core.grpc_util import Refused, Server, serve
from overworld.core.imports import UserCodeError, import_object
from overworld.core.service import log_refusal
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.trainer.placement import PlacementError
from overworld.trainer.runtime import TrainerRuntime
from overworld.v1 import trainer_pb2 as pb
from overworld.v1 import trainer_pb2_grpc

log = logging.getLogger("overworld.trainer")

UPDATES = Counter("overworld_trainer_updates_total", "Optimizer steps")
SAMPLES = Counter("overworld_trainer_samples_total", "Environment steps trained on")
ITERATION = Gauge("overworld_trainer_iteration", "Training iteration")
VERSION = Gauge("overworld_trainer_model_version", "Model version published")
LOSS = Gauge("overworld_trainer_loss", "Loss terms of the last iteration", ["term"])
APPROX_KL = Gauge("overworld_trainer_approx_kl", "Approximate KL to the behaviour policy")
LAST_UPDATE = Gauge("overworld_trainer_last_update_timestamp_seconds", "Unix time of the last iteration")
SAMPLE_WAIT = Counter("overworld_trainer_sample_wait_seconds_total",
                      "Seconds the learner (rank 0) spent getting its batches from the replay buffer: over wall "
                      "seconds, the share of its time it waits for the fleet")

STOP_TIMEOUT_SECONDS = 120
MAX_STOP_SECONDS = 3600  # RequestStop's deadline: no node's grace period is longer
# From the SIGTERM, the stop's deadline is the pod's grace period (`--stop-grace-seconds`) less this: the
# process's exit after the checkpoint (Ray's shutdown, the status server's).
EXIT_SECONDS = 5.0
# A trainer that ended by itself keeps answering GetStatus this long, until its final state has been
# read: `overworld run` and the run-controller poll it, and a trainer gone before they saw "finished"
# looks like one that crashed (restarted, then resumed from its last checkpoint only to finish again).
FINAL_STATE_SECONDS = 5.0
# MineStudio names its PPO PPOTrainer; here it is the learner itself (overworld.online.PPOTrainer adds
# only MineStudio's constructor and attribute names).
TRAINERS = {"PPOTrainer": "overworld.trainer.learner:PPOLearner", "PPOLearner": "overworld.trainer.learner:PPOLearner"}
# overworld_trainer_loss{term=...}: the dashboards' labels for the logged loss terms
LOSS_GAUGE_LABELS = {"policy": "trainer/policy_loss", "value": "trainer/value_loss", "kl": "trainer/kl_divergence_loss",
              "entropy": "trainer/entropy_bonus", "total": "trainer/total_loss"}


def trainer_class(name: str) -> type[TrainerRuntime]:
    """`trainer_name`: PPOTrainer (MineStudio's name for Overworld's PPO), or the import path of a
    subclass ('module:Class' or 'file.py:Class', e.g. of overworld.online.PPOTrainer)."""
    if ":" not in name and name not in TRAINERS:
        raise TypeError(f"trainer_name {name!r}: not a trainer Overworld knows ({', '.join(TRAINERS)}); give a "
                        "subclass by import path ('module:Class' or 'file.py:Class')")
    cls = import_object(TRAINERS.get(name, name))
    if not (isinstance(cls, type) and issubclass(cls, TrainerRuntime)):
        raise TypeError(f"trainer_name {name!r} is not a trainer (a subclass of overworld.online.BaseTrainer or "
                        "overworld.trainer.learner.PPOLearner)")
    return cls


class NodeGoing(Exception):
    """Training stopped because one of its nodes is going (RequestStop): the attempt fails, to be retried."""


class TrainerStatusService(trainer_pb2_grpc.TrainerServicer):
    def __init__(self) -> None:
        self.status = pb.TrainerStatus(state="starting")
        self.stop_requested = threading.Event()
        self.stop_deadline: float | None = None  # time.monotonic() by which the stop must be done, if known
        self.node_going = ""  # why a node asked to stop (RequestStop): the attempt then ends as failed
        self.training_loop_started = threading.Event()  # rank 0 has reported: stops go through it
        self.final_state_read = threading.Event()  # someone has read "finished" or "failed"
        self._lock = threading.Lock()

    def GetStatus(self, request, context):
        with self._lock:
            out = pb.TrainerStatus()
            out.CopyFrom(self.status)
        out.stop_requested = self.stop_requested.is_set()
        out.stop_seconds_left = self.seconds_left()
        if out.state in ("finished", "failed"):
            self.final_state_read.set()
        return out

    def ReportProgress(self, request, context):
        waited = request.metrics.get("trainer/sample_wait_seconds_total", 0.0)
        with self._lock:
            UPDATES.inc(max(0, request.updates - self.status.updates))
            SAMPLES.inc(max(0, request.samples_trained - self.status.samples_trained))
            SAMPLE_WAIT.inc(max(0.0, waited - self.status.metrics.get("trainer/sample_wait_seconds_total", 0.0)))
            self.status.CopyFrom(request)
        ITERATION.set(request.iteration)
        VERSION.set(request.model_version)
        for term, key in LOSS_GAUGE_LABELS.items():
            if key in request.metrics:
                LOSS.labels(term).set(request.metrics[key])
        if "trainer/approx_kl" in request.metrics:
            APPROX_KL.set(request.metrics["trainer/approx_kl"])
        LAST_UPDATE.set(time.time())
        self.training_loop_started.set()
        return pb.ReportProgressResponse(stop=self.stop_requested.is_set())

    def RequestStop(self, request, context):
        seconds = request.seconds_left
        if not (math.isfinite(seconds) and 0 < seconds <= MAX_STOP_SECONDS) or len(request.reason) > 200:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"RequestStop: seconds_left must be in (0, {MAX_STOP_SECONDS}] (got {seconds}) and the "
                          f"reason at most 200 characters (got {len(request.reason)})")
        log.warning("a node of the trainer's is going (%s): checkpointing within %.0fs, then ending this attempt "
                    "for KubeRay's retry to resume", request.reason or "no reason given", seconds)
        self.node_going = request.reason or "a node of the trainer's was going"
        self.request_stop(deadline_in=max(1.0, seconds - EXIT_SECONDS))
        return self.GetStatus(request, context)

    def request_stop(self, deadline_in: float | None = None) -> None:
        """Ask training to stop; with `deadline_in`, by that many seconds from now."""
        if deadline_in is not None and self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + deadline_in
        self.stop_requested.set()

    def seconds_left(self) -> float:
        """Seconds to the stop's deadline (0: none known; a deadline passed answers a millisecond)."""
        if self.stop_deadline is None:
            return 0.0
        return max(0.001, self.stop_deadline - time.monotonic())

    def set_state(self, state: str, error: str = "") -> None:
        with self._lock:
            self.status.state = state
            self.status.error = error


RAY_START_ATTEMPTS = 3
RAY_SHUTDOWN_SECONDS = 60  # the training thread's ray.shutdown (it takes ~5 s on a busy laptop)
# A Ray of its own for one run on this machine gets only what the trainer uses: no dashboard, no usage
# report, no metrics agent work, a small object store (weights and batches travel over gRPC, not
# through Ray), no Ray Train preemption watcher or metrics callbacks. bench/bench_startup.py measures
# each knob; a variable already set in the environment wins.
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every Ray socket on loopback (read by Ray at import)
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
}
LOCAL_RAY_INIT: dict[str, Any] = {"include_dashboard": False, "object_store_memory": 128 * 2**20,
                                  "_system_config": {"enable_metrics_collection": False}}


def start_ray(address: str) -> None:
    """Start a local Ray (`address` empty) or join a cluster, trying again on a start that timed out:
    on a busy machine the raylet can miss Ray's startup deadline, and one slow start must not fail a run."""
    if not address:
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)
    # Ray nices its workers to 15 by default; the learner must not yield to every other process.
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray
    from ray._private import ray_constants

    # ray.init installs a C++ failure-signal handler in this process that turns SIGTERM into an abort
    # two seconds later: the driver would die while it waits for rank 0's checkpoint (a kubectl resume,
    # a drained head pod). Read when ray.init makes the driver's core worker; this process only (Ray's
    # own processes keep their crash reports).
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    started = time.monotonic()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                ray.init(log_to_driver=True, configure_logging=False, **LOCAL_RAY_INIT)
            log.info("Ray started in %.1fs", time.monotonic() - started)
            return
        except Exception as err:
            ray.shutdown()
            if attempt == RAY_START_ATTEMPTS:
                raise
            log.warning("Ray did not start (attempt %d of %d): %s; trying again", attempt, RAY_START_ATTEMPTS, err)
            time.sleep(5.0 * attempt)


_RAY_SHUTDOWN = threading.Lock()  # the driver's stop and its training thread may both get there


def shutdown_ray() -> None:
    """ray.shutdown(), if this process ever imported Ray and it is up (local mode never imports it)."""
    ray = sys.modules.get("ray")
    with _RAY_SHUTDOWN:
        if ray is not None and ray.is_initialized():
            ray.shutdown()


def keep_ray_until_released(released: threading.Event) -> None:
    """Called by the thread that started Ray once it is done with it: Ray's head processes die with the
    thread that spawned them (Ray asks Linux for SIGKILL on the death of the parent *thread*), so this
    thread waits until the process no longer needs Ray, then shuts it down in order."""
    if "ray" in sys.modules:
        released.wait()
        shutdown_ray()


def advertised_host(bind_host: str) -> str:
    """Where Ray Train workers (possibly other pods) reach this driver's status endpoint."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


def apply_flags(config: RunConfig, resume: str, save_path: str) -> RunConfig:
    """`--resume` and `--save-path` (OVERWORLD_RESUME, OVERWORLD_SAVE_PATH) win over the run config:
    they are the deployment's say (the chart points save_path at the object store). `--resume auto`
    (a restarted trainer) leaves `resume` to the config: see `continue_run`."""
    if resume and resume != "auto":
        config.train_config.resume = resume
    if save_path:
        if save_path != config.train_config.save_path:
            log.info("save_path %s (--save-path / OVERWORLD_SAVE_PATH) replaces the run config's %r",
                     save_path, config.train_config.save_path)
        config.train_config.save_path = save_path
    return config


class TrainerDriver:
    def __init__(self, rollout_manager: str, replay_buffer: str, gae: str, model_registry: str, host: str,
                 port: int, ray_address: str, workdir: str, resume: str, done: threading.Event,
                 config_path: str = "", save_path: str = "", stop_grace: float = 0.0) -> None:
        self.status = TrainerStatusService()
        self.stop_grace = stop_grace  # the pod's grace period from the SIGTERM (0: not known)
        self.server: Server = serve([(trainer_pb2_grpc.add_TrainerServicer_to_server, self.status,
                                      "overworld.v1.Trainer")], host, port)
        # TrainerRuntime.from_config's keyword arguments
        self.addresses: dict[str, Any] = {"rollout_manager": rollout_manager, "replay_buffer": replay_buffer, "gae": gae,
                          "model_registry": model_registry, "status_address": f"{advertised_host(host)}:{self.server.port}",
                          "workdir": workdir}
        if resume == "auto":  # a restarted trainer: this run's latest checkpoint, else the config's `resume`
            self.addresses["continue_run"] = True
        self.ray_address = ray_address
        self.done = done
        self.failed = False
        self._trainer: TrainerRuntime | None = None
        self._configured = threading.Event()  # the config is here (or failed): whether Ray is needed is known
        self._started = threading.Event()  # the config is here and the first version published (or failed)
        self._startup_error: Exception | None = None
        # Ray starts in the thread that trains as soon as the config says it is needed (num_workers > 0),
        # while this one publishes the first version. Ray's processes are bound to the thread that
        # started them (PR_SET_PDEATHSIG: SIGKILL when that *thread* exits), so that thread also shuts
        # Ray down, once `stop` lets it: training that ended by itself leaves Ray running until then.
        self._ray_released = threading.Event()
        self.config_error = False  # failed in a way a restart would repeat (EXIT_CONFIG)
        self._thread = threading.Thread(target=self._fit, name="trainer-fit", daemon=True)
        self._thread.start()
        try:
            self.config = RolloutManagerClient(rollout_manager).run_config()
            if config_path:  # the trainer's own config (overworld.online.start_trainer); the run is the manager's
                own = load_config(config_path)
                own.run_id = self.config.run_id
                self.config = own
            self.config = apply_flags(self.config, resume, save_path)
            if self.config.train_config.num_workers == 0 and ray_address:  # before anything that waits
                raise PlacementError(
                    "train_config.num_workers=0 (Ray Train's local mode) would train in this driver's process, "
                    f"not on the Ray cluster at {ray_address}: give num_workers >= 1 there")
            self._configured.set()
            self._trainer = trainer_class(self.config.trainer_name).from_config(self.config, **self.addresses)
            self._trainer.publish_first_version()  # the workers start stepping while Ray starts
        except Exception as err:
            self._startup_error = err
        finally:
            self._configured.set()
            self._started.set()

    def _fit(self) -> None:
        try:
            self._configured.wait()
            local_mode = self._startup_error is None and self.config.train_config.num_workers == 0
            if local_mode:
                log.info("train_config.num_workers=0: local mode (Ray Train's local mode without Ray), the learner "
                         "trains in this process (Ray is neither started nor imported)")
            elif self._startup_error is None:
                start_ray(self.ray_address)
            self._started.wait()
            if self._startup_error is not None:
                raise self._startup_error
            if self.status.stop_requested.is_set():  # stopped while Ray started: nothing to train or save
                log.info("stop requested before training started: not training")
                self._end_if_a_node_is_going()
                return
            assert self._trainer is not None
            if not self.ray_address:
                self._trainer.placement_timeout = 0  # a Ray this driver started has what it has: no waiting
                self._trainer.own_ray = not local_mode
            self.status.set_state("running")
            self._trainer.fit()
            self._end_if_a_node_is_going()
            self.status.set_state("finished")
            log.info("training finished")
        except NodeGoing as err:
            log.warning("%s", err)
            self.failed = True
            self.status.set_state("failed", str(err)[:2000])
        except PlacementError as err:
            log.error("the trainer's workers cannot be placed: %s", err)
            self.failed = self.config_error = True
            self.status.set_state("failed", str(err)[:2000])
        except (UserCodeError, ConfigError) as err:  # the user's generator or config: a restart would repeat it
            log_refusal(log, err)
            self.failed = self.config_error = True
            self.status.set_state("failed", str(err)[:2000])
        except Exception as err:
            log.exception("training failed")
            self.failed = True
            self.status.set_state("failed", str(err)[:2000])
        finally:
            self.done.set()
            keep_ray_until_released(self._ray_released)

    def _end_if_a_node_is_going(self) -> None:
        """Not finished when a node asked to stop: the attempt fails, and KubeRay's retry resumes from the
        checkpoint just written."""
        if self.status.node_going:
            raise NodeGoing(f"stopped because {self.status.node_going}; checkpointed "
                            f"{self.status.status.latest_checkpoint or 'nothing'}: the next attempt resumes")

    def stop(self, grace: float = 5.0) -> None:
        """Ask rank 0 to checkpoint after the current iteration and finish; then shut Ray down (if this
        process ever imported it: local mode never does). With a grace period, the learners know its
        deadline: an update that would outlast it is cut short for the checkpoint."""
        ended = self.status.status.state in ("finished", "failed")
        if ended:  # ended by itself, not by a signal
            self.status.final_state_read.wait(FINAL_STATE_SECONDS)
        budget = float(STOP_TIMEOUT_SECONDS)
        if self.stop_grace > 0 and not ended:
            budget = max(1.0, self.stop_grace - EXIT_SECONDS)
            log.info("stopping within the grace period: checkpoint within %.0fs", budget)
            self.status.request_stop(deadline_in=budget)
        else:
            self.status.request_stop()
        if self.status.training_loop_started.is_set():
            if not self.done.wait(budget):
                log.warning("training did not finish within %.0fs of the stop request; shutting Ray down", budget)
        elif not self.done.is_set():  # Ray Train is still placing or starting its workers (minutes on a cluster)
            log.info("stop requested before the training loop started: nothing to checkpoint; shutting Ray down")
        self._ray_released.set()
        if not self.done.is_set():  # training still runs (or places): shutting Ray down here ends it
            shutdown_ray()
        self._thread.join(RAY_SHUTDOWN_SECONDS)
        self.server.stop(grace)
