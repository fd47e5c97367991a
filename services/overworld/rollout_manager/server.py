"""The rollout-manager: hands out the run config, keeps the fleet (leases, heartbeats), owns the
run's spaces, aggregates episode statistics, and brokers episode videos (requests handed to
workers in heartbeat replies, MP4s stored in a blob store and listed).

Its state (run id, spaces, fleet and each worker's cumulative counters, episode statistics) is saved
in a state store (`state.py`: Redis, or a file beside the run), so that a restarted manager takes up
where it was: workers keep their ids and leases (each restored worker gets a fresh lease), env steps
and episode counts go on from where they were. Every change is saved before the lock is released,
so a restarted manager never reports less than it did (a heartbeat rewrites only its worker's part).
An episode report is acknowledged only once saved and carries a per-worker sequence number, so a
retried report is never counted twice. Video requests not yet answered are not saved.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from prometheus_client import Counter, Gauge

from overworld.core.blobs.store import BlobStore
from overworld.core.config import RunConfig, config_hash, to_yaml
from overworld.core.grpc_util import Backoff, Refused
from overworld.core.specs import Spaces
from overworld.rollout_manager.state import StateStore, StateUnavailable
from overworld.rollout_manager.videos import VideoBook, video_store_url
from overworld.v1 import common_pb2, rollout_manager_pb2, rollout_manager_pb2_grpc

log = logging.getLogger("overworld.rollout_manager")

WORKERS = Gauge("overworld_rollout_workers", "Rollout workers holding a live lease")
EPISODES = Counter("overworld_episodes_total", "Episodes finished", ["task"])
EPISODE_RETURN = Gauge("overworld_episode_return", "Mean return of the last 100 episodes", ["task"])
PREEMPTED_ENV_STEPS = Counter("overworld_fleet_preempted_env_steps_total",
                              "Env steps the fleet's workers stepped, then threw away as they stopped (preempted, "
                              "scaled down, deleted), from their last heartbeats")
EPISODE_LENGTH = Gauge("overworld_episode_length", "Mean length of the last 100 episodes", ["task"])

WINDOW = 100
STATE_WAIT_SECONDS = 60.0  # at start, how long to wait for the state store
STATE_FORMAT = 1


@dataclass
class WorkerRecord:
    worker_id: str
    hostname: str
    address: str
    num_envs: int
    last_heartbeat: float
    env_steps: int = 0
    fragments_sent: int = 0
    model_version: int = 0
    env_steps_per_second: float = 0.0
    env_restarts: dict[str, int] = field(default_factory=dict)
    fragments_dropped: int = 0
    send_queue_depth: int = 0
    fragments_completed: int = 0
    envs_ready: int = 0
    room_wait_seconds: float = 0.0
    env_slot_seconds: float = 0.0
    preempted_env_steps: int = 0


@dataclass
class TaskRecord:
    episodes: int = 0
    returns: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    lengths: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    discounted: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    extras: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    total_return: float = 0.0
    total_discounted: float = 0.0
    total_length: int = 0
    total_extras: dict[str, float] = field(default_factory=dict)


class RolloutManagerService(rollout_manager_pb2_grpc.RolloutManagerServicer):
    def __init__(self, config: RunConfig, lease_seconds: float = 15.0, video_store: BlobStore | None = None,
                 workdir: str = ".", blobs: str = "", state: StateStore | None = None, fresh: bool = False) -> None:
        """`state`: where the manager's state survives a restart (None: nowhere, it lives and dies with
        the process); restored from there unless `fresh` (then cleared)."""
        self.config = config
        self.lease_seconds = lease_seconds
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerRecord] = {}
        self._departed_steps = 0
        self._departed_fragments = 0
        self._departed_room_wait = 0.0
        self._departed_slot_seconds = 0.0
        self._departed_preempted = 0
        self._fragments_lost = 0
        self._spaces: Spaces | None = None
        self._spaces_proto: common_pb2.Spaces | None = None
        self._tasks: dict[str, TaskRecord] = {}
        self._all_returns: deque = deque(maxlen=WINDOW)
        self._episodes = 0
        self._registrations = 0
        self._reports: dict[str, int] = {}  # worker id -> the last report_sequence applied
        self._state = state
        # What failed saves left unsaved (parts, and worker records to remove): they go with the next save.
        self._unsaved_parts: dict[str, Any] = {}
        self._unsaved_gone: set[str] = set()
        self.run_id = config.run_id
        self.fleet_id = uuid.uuid4().hex[:12]  # a restored state keeps its own (see FleetStatus.fleet_id)
        if state is not None:
            if fresh:
                state.clear()
            else:
                self._restore(state)
        self.run_id = self.run_id or uuid.uuid4().hex[:12]
        self.config.run_id = self.run_id
        self._yaml = to_yaml(config)
        self._hash = config_hash(config)
        with self._lock:
            self._save(run=True, episodes=True, workers=tuple(self._workers.values()))
        url = video_store_url(config.rollout_config.worker_config.video_output_dir, workdir, blobs)
        wc = config.rollout_config.worker_config
        self.videos = VideoBook(video_store, url, self.run_id, config.train_config.record_video_interval,
                                wc.video_episodes, video_store_url(wc.video_output_dir, workdir))

    # -- state that survives a restart ------------------------------------------------------------
    def _restore(self, store: StateStore) -> None:
        saved = _load(store)
        run = saved.get("run")
        if not run:
            log.info("no saved state in %s: a new fleet", store.where)
            return
        if run.get("format") != STATE_FORMAT:
            raise StateUnavailable(f"{store.where} holds state format {run.get('format')}, "
                                   f"this manager reads {STATE_FORMAT}")
        if self.run_id and run["run_id"] != self.run_id:
            raise StateUnavailable(f"{store.where} holds the state of run {run['run_id']}, not {self.run_id}")
        self.run_id = run["run_id"]
        self.fleet_id = run.get("fleet_id") or self.fleet_id
        if run["spaces"]:
            self._spaces_proto = common_pb2.Spaces.FromString(base64.b64decode(run["spaces"]))
            self._spaces = Spaces.from_proto(self._spaces_proto)
        self._departed_steps, self._departed_fragments = run["departed_steps"], run["departed_fragments"]
        self._departed_room_wait = run.get("departed_room_wait", 0.0)  # absent in states saved before them
        self._departed_slot_seconds = run.get("departed_slot_seconds", 0.0)
        self._departed_preempted = run.get("departed_preempted_env_steps", 0)
        self._fragments_lost, self._registrations = run["fragments_lost"], run["registrations"]
        self._reports = {k: int(v) for k, v in run["reports"].items()}
        now = time.monotonic()
        names = {f.name for f in dataclasses.fields(WorkerRecord)}
        for part, w in saved.items():
            if part.startswith("worker:"):  # a fresh lease: it has lease_seconds to heartbeat again
                record = WorkerRecord(**{k: v for k, v in w.items() if k in names}, last_heartbeat=now)
                self._workers[record.worker_id] = record
        episodes = saved.get("episodes") or {"episodes": 0, "all_returns": [], "tasks": {}}
        self._episodes = episodes["episodes"]
        self._all_returns.extend(episodes["all_returns"])
        for name, values in episodes["tasks"].items():
            task = self._tasks[name] = TaskRecord()
            for key, value in values.items():
                current = getattr(task, key, None)
                if isinstance(current, deque):
                    current.extend(value)
                elif current is not None:
                    setattr(task, key, value)
            if task.returns:
                EPISODE_RETURN.labels(name).set(float(np.mean(task.returns)))
                EPISODE_LENGTH.labels(name).set(float(np.mean(task.lengths)))
        WORKERS.set(len(self._workers))
        log.info("restored from %s: %d workers, %d env steps, %d episodes", store.where, len(self._workers),
                 self._departed_steps + sum(w.env_steps for w in self._workers.values()), self._episodes)

    def _save(self, run: bool = False, episodes: bool = False, workers: tuple[WorkerRecord, ...] = (),
              gone: tuple[str, ...] = (), strict: bool = False) -> None:
        """Save the parts that changed, under self._lock: whatever a client is told has been saved. A
        failed save raises StateUnavailable when strict (the caller must not acknowledge), else it is
        logged; either way what it did not save (parts, and records to remove) goes with the next save, so
        that a departed worker is never both counted as departed and restored."""
        if self._state is None:
            return
        parts: dict[str, Any] = {f"worker:{w.worker_id}": {k: v for k, v in dataclasses.asdict(w).items()
                                                          if k != "last_heartbeat"} for w in workers}
        if run:
            parts["run"] = {
                "format": STATE_FORMAT, "run_id": self.run_id, "fleet_id": self.fleet_id,
                "registrations": self._registrations,
                "spaces": base64.b64encode(self._spaces_proto.SerializeToString()).decode() if self._spaces_proto else "",
                "departed_steps": self._departed_steps, "departed_fragments": self._departed_fragments,
                "departed_room_wait": self._departed_room_wait, "departed_slot_seconds": self._departed_slot_seconds,
                "departed_preempted_env_steps": self._departed_preempted,
                "fragments_lost": self._fragments_lost, "reports": self._reports}
        if episodes:
            parts["episodes"] = {
                "episodes": self._episodes, "all_returns": list(self._all_returns),
                "tasks": {name: {k: list(v) if isinstance(v, deque) else v for k, v in vars(t).items()}
                          for name, t in self._tasks.items()}}
        gone_parts = self._unsaved_gone | {f"worker:{worker_id}" for worker_id in gone}
        parts = {name: value for name, value in {**self._unsaved_parts, **parts}.items() if name not in gone_parts}
        try:
            self._state.save(parts, sorted(gone_parts))
            self._unsaved_parts, self._unsaved_gone = {}, set()
        except StateUnavailable as err:
            self._unsaved_parts, self._unsaved_gone = parts, gone_parts
            if strict:
                raise
            log.warning("state not saved (it goes with the next save): %s", err)

    def _expire(self) -> None:
        now = time.monotonic()
        expired = [worker_id for worker_id, w in self._workers.items() if now - w.last_heartbeat > self.lease_seconds]
        for worker_id in expired:
            w = self._workers[worker_id]
            log.warning("worker %s (%s) missed its lease; removed from the fleet (%d fragments it had not had "
                        "acknowledged are counted as lost)", worker_id, w.hostname, w.send_queue_depth)
            self._fragments_lost += w.send_queue_depth
            self._depart(worker_id)
        WORKERS.set(len(self._workers))
        if expired:
            self._save(run=True, gone=tuple(expired))

    def _depart(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        self.videos.release(worker_id)
        if w:
            self._departed_steps += w.env_steps
            self._departed_fragments += w.fragments_sent
            self._departed_room_wait += w.room_wait_seconds
            self._departed_slot_seconds += w.env_slot_seconds
            self._departed_preempted += w.preempted_env_steps

    def GetRunConfig(self, request, context):
        return rollout_manager_pb2.RunConfig(run_id=self.run_id, config_yaml=self._yaml, config_hash=self._hash)

    def Register(self, request, context):
        if request.num_envs == 0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "num_envs must be > 0")
        try:
            spaces = Spaces.from_proto(request.spaces)
        except TypeError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"spaces: {err}") from None
        if not spaces.obs or not spaces.action:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "spaces must declare at least one obs and one action")
        with self._lock:
            if self._spaces is None:
                self._spaces, self._spaces_proto = spaces, request.spaces
                log.info("run spaces declared: %s", spaces)
            elif spaces != self._spaces:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                      f"this worker's spaces {spaces} differ from the run's {self._spaces}: "
                      "is it running a different env or policy?")
            worker_id = f"w-{uuid.uuid4().hex[:8]}"
            worker_index = self._registrations
            self._registrations += 1
            record = self._workers[worker_id] = WorkerRecord(worker_id, request.hostname, request.address,
                                                             request.num_envs, time.monotonic())
            self._expire()
            self._save(run=True, workers=(record,))  # not saved: after a restart its heartbeat re-registers it
        log.info("worker %s registered from %s with %d envs", worker_id, request.hostname, request.num_envs)
        return rollout_manager_pb2.RegisterResponse(worker_id=worker_id, lease_seconds=self.lease_seconds,
                                                    run_id=self.run_id, worker_index=worker_index)

    def Heartbeat(self, request, context):
        with self._lock:
            self._expire()
            w = self._workers.get(request.worker_id)
            if w is None:
                return rollout_manager_pb2.HeartbeatResponse(lease_valid=False)
            w.last_heartbeat = time.monotonic()
            w.env_steps = max(w.env_steps, request.env_steps)
            w.fragments_sent = max(w.fragments_sent, request.fragments_sent)
            w.model_version = request.model_version
            w.env_steps_per_second = request.env_steps_per_second
            w.env_restarts = dict(request.env_restarts)
            w.fragments_dropped = request.fragments_dropped
            w.send_queue_depth = request.send_queue_depth
            w.fragments_completed = max(w.fragments_completed, request.fragments_completed)
            w.envs_ready = request.envs_ready
            w.room_wait_seconds = max(w.room_wait_seconds, request.room_wait_seconds)
            w.env_slot_seconds = max(w.env_slot_seconds, request.env_slot_seconds)
            if request.preempted_env_steps > w.preempted_env_steps:
                PREEMPTED_ENV_STEPS.inc(request.preempted_env_steps - w.preempted_env_steps)
                w.preempted_env_steps = request.preempted_env_steps
            version = max(x.model_version for x in self._workers.values())
            self._save(workers=(w,))
        self.videos.on_model_version(version)
        video = self.videos.assign(request.worker_id)
        return rollout_manager_pb2.HeartbeatResponse(lease_valid=True, record_video=bool(video),
                                                     video_request_id=video)

    def Deregister(self, request, context):
        with self._lock:
            self._depart(request.worker_id)
            WORKERS.set(len(self._workers))
            self._save(run=True, gone=(request.worker_id,))
        log.info("worker %s left the fleet", request.worker_id)
        return rollout_manager_pb2.DeregisterResponse()

    def ReportEpisodes(self, request, context):
        for ep in request.episodes:
            values = [ep.sum_reward, ep.discounted_reward, *ep.extras.values()]
            if not np.all(np.isfinite(values)):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "episode statistics contain NaN or infinity")
        with self._lock:
            sequence = request.report_sequence
            if sequence and sequence <= self._reports.get(request.worker_id, 0):
                log.info("episode report %d of %s was applied before; acknowledged again", sequence,
                         request.worker_id)
                if self._unsaved_parts or self._unsaved_gone:  # applied, but a save failed since: save first
                    self._save_or_abort(context)
                return rollout_manager_pb2.ReportEpisodesResponse()
            if sequence:
                self._reports[request.worker_id] = sequence
            for ep in request.episodes:
                task = ep.task or "default"
                t = self._tasks.setdefault(task, TaskRecord())
                t.episodes += 1
                t.returns.append(ep.sum_reward)
                t.lengths.append(ep.length)
                t.discounted.append(ep.discounted_reward)
                t.extras.append(dict(ep.extras))
                t.total_return += ep.sum_reward
                t.total_discounted += ep.discounted_reward
                t.total_length += ep.length
                for k, v in ep.extras.items():
                    t.total_extras[k] = t.total_extras.get(k, 0.0) + v
                self._all_returns.append(ep.sum_reward)
                self._episodes += 1
                EPISODES.labels(task).inc()
                EPISODE_RETURN.labels(task).set(float(np.mean(t.returns)))
                EPISODE_LENGTH.labels(task).set(float(np.mean(t.lengths)))
            self._save_or_abort(context)
        return rollout_manager_pb2.ReportEpisodesResponse()

    def _save_or_abort(self, context: grpc.ServicerContext) -> None:
        """Episodes are acknowledged only once saved: if the save fails the worker sends the same report
        again, and its sequence number keeps it from being counted twice."""
        try:
            self._save(run=True, episodes=True, strict=True)
        except StateUnavailable as err:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"rollout-manager state store unavailable ({err}); retry") from None

    def GetSpaces(self, request, context):
        with self._lock:
            if self._spaces_proto is None:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "no rollout worker has declared the run's spaces yet")
            return self._spaces_proto

    def GetFleetStatus(self, request, context):
        now = time.monotonic()
        with self._lock:
            self._expire()
            workers = [
                rollout_manager_pb2.WorkerInfo(
                    worker_id=w.worker_id, hostname=w.hostname, address=w.address, num_envs=w.num_envs,
                    env_steps=w.env_steps, fragments_sent=w.fragments_sent, model_version=w.model_version,
                    seconds_since_heartbeat=now - w.last_heartbeat, env_steps_per_second=w.env_steps_per_second,
                    env_restarts=w.env_restarts, fragments_dropped=w.fragments_dropped,
                    send_queue_depth=w.send_queue_depth, fragments_completed=w.fragments_completed,
                    envs_ready=w.envs_ready, room_wait_seconds=w.room_wait_seconds,
                    env_slot_seconds=w.env_slot_seconds)
                for w in self._workers.values()
            ]
            tasks = []
            for name, t in sorted(self._tasks.items()):
                keys = sorted({k for e in t.extras for k in e})
                extras = {k: float(np.mean([e.get(k, 0.0) for e in t.extras])) for k in keys}
                tasks.append(rollout_manager_pb2.TaskStats(
                    task=name, episodes=t.episodes, mean_return_last_100=float(np.mean(t.returns)),
                    mean_length_last_100=float(np.mean(t.lengths)),
                    mean_discounted_return_last_100=float(np.mean(t.discounted)), mean_extras_last_100=extras,
                    total_return=t.total_return, total_discounted_return=t.total_discounted,
                    total_length=t.total_length,
                    total_extras=t.total_extras))
            return rollout_manager_pb2.FleetStatus(
                run_id=self.run_id, fleet_id=self.fleet_id, workers=workers,
                env_steps=self._departed_steps + sum(w.env_steps for w in self._workers.values()),
                fragments_sent=self._departed_fragments + sum(w.fragments_sent for w in self._workers.values()),
                fragments_lost=self._fragments_lost, episodes=self._episodes,
                mean_return_last_100=float(np.mean(self._all_returns)) if self._all_returns else 0.0,
                tasks=tasks, videos=len(self.videos.list()), pending_video_requests=self.videos.pending(),
                room_wait_seconds=self._departed_room_wait + sum(w.room_wait_seconds for w in self._workers.values()),
                env_slot_seconds=self._departed_slot_seconds + sum(w.env_slot_seconds for w in self._workers.values()),
                preempted_env_steps=self._departed_preempted + sum(w.preempted_env_steps for w in self._workers.values()))

    def ListLeases(self, request, context):
        with self._lock:
            self._expire()
            return rollout_manager_pb2.Leases(worker_ids=list(self._workers), lease_seconds=self.lease_seconds)

    def RequestVideo(self, request, context):
        return rollout_manager_pb2.RequestVideoResponse(request_id=self.videos.request(request.iteration))

    def UploadVideo(self, request_iterator: Iterator[rollout_manager_pb2.VideoChunk],
                    context: grpc.ServicerContext) -> rollout_manager_pb2.VideoInfo:
        info: rollout_manager_pb2.VideoInfo | None = None
        parts: list[bytes] = []
        for chunk in request_iterator:
            if info is None:
                if not chunk.HasField("info"):
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the first chunk must carry the video's info")
                info = chunk.info
            parts.append(chunk.data)
        if info is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "empty upload")
        data = b"".join(parts)
        if not data.startswith(b"\x00\x00\x00") or b"ftyp" not in data[:16]:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "not an MP4 file")
        try:
            return self.videos.store_video(info, data)
        except OSError as err:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"video store {self.videos.store_url}: {err}") from None

    def ListVideos(self, request, context):
        return rollout_manager_pb2.ListVideosResponse(videos=self.videos.list())


def _load(store: StateStore, wait: float = STATE_WAIT_SECONDS) -> dict[str, Any]:
    """The saved state, waiting out a store that is down (Redis restarting) for up to `wait` seconds;
    then StateUnavailable, and the manager does not start (its supervisor restarts it)."""
    end = time.monotonic() + wait
    backoff = Backoff(0.2)
    while True:
        try:
            return store.load()
        except StateUnavailable as err:
            if time.monotonic() >= end:
                raise
            log.warning("cannot load the saved state yet: %s", err)
            backoff.wait()
