"""The rollout worker: N environment slots in groups, batched policy inference on one group while
the other group steps, fragments cut per slot and streamed to the replay buffer, new weights
swapped in between batches, episode statistics and videos to the rollout-manager.

A slot starts a fragment only with room reserved in the replay buffer (replay_buffer/reservations.py):
when the learner is behind, slots wait at a fragment boundary instead of stepping data that would be
dropped as stale."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import grpc
import numpy as np
import torch

from overworld.core.config import RunConfig
from overworld.core.grpc_util import attempt_again, call_failed
from overworld.core.specs import Spaces
from overworld.core.wire.fragment import Fragment
from overworld.model_registry.worker.relay import RelayShelf
from overworld.model_registry.worker.watcher import WeightsWatcher
from overworld.policies.factory import run_spaces
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.client import PERIODIC_TIMEOUT, RolloutManagerClient
from overworld.rollout_worker.env_pool import EnvPool, GroupResult, InProcessEnvPool, num_groups_for
from overworld.rollout_worker.env_runner import TASK_KEY
from overworld.rollout_worker.episodes import EpisodeTracker
from overworld.rollout_worker.fragments import FragmentCutter
from overworld.rollout_worker.metrics import (
    ENV_SLOTS,
    ENV_STEPS,
    FRAGMENTS_DROPPED,
    FRAGMENTS_SENT,
    INFER_BATCH,
    INFER_LATENCY,
    MODEL_VERSION,
    POLICY_LAG,
    PREEMPTED_ENV_STEPS,
    QUEUE_DEPTH,
    ROOM_WAIT,
    SLOTS_WAITING_FOR_ROOM,
    STEP_LATENCY,
)
from overworld.rollout_worker.pipeline_report import PipelineReport
from overworld.rollout_worker.video import VideoRecorder, image_key
from overworld.v1 import common_pb2
from overworld.v1 import rollout_manager_pb2 as mpb

log = logging.getLogger("overworld.rollout_worker")


def pick_device(name: str, num_gpus: float = 1.0) -> torch.device:
    """`device: auto`: CUDA when rollout_config.num_gpus_per_worker asks for a GPU and one is there
    (said out loud when it is not), else the CPU."""
    if name != "auto":
        return torch.device(name)
    if num_gpus > 0 and not torch.cuda.is_available():
        log.warning("rollout_config.num_gpus_per_worker=%s but this worker sees no CUDA device: inference runs on "
                    "the CPU", num_gpus)
    return torch.device("cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu")


def make_pool(config: RunConfig, spaces: Spaces, seed: int, backend: str | None = None) -> EnvPool | InProcessEnvPool:
    wc = config.rollout_config.worker_config
    backend = backend or getattr(wc, "env_backend", "") or os.environ.get("OVERWORLD_ENV_BACKEND", "") or "subprocess"
    n = wc.num_envs
    groups = num_groups_for(n, wc.batch_size)
    if backend == "inprocess":
        return InProcessEnvPool(config.env_generator, dict(config.env_kwargs), spaces, n, groups, seed,
                                wc.restart_interval)
    if backend != "subprocess":
        raise ValueError(f"worker_config.env_backend: {backend!r} is neither 'subprocess' nor 'inprocess'")
    processes = wc.num_env_processes or min(n, os.cpu_count() or 1)
    return EnvPool(config.env_generator, dict(config.env_kwargs), spaces, n, processes, groups, seed,
                   wc.step_timeout, wc.restart_interval)


def sample_with_log_prob(logits: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`policies.base.sample` and `log_prob` for one step (logits (B, 1, n)), without building
    torch.distributions objects (their argument validation costs more than a small policy's forward)."""
    total: torch.Tensor | None = None
    actions = {}
    for k, v in logits.items():
        logp_all = torch.log_softmax(v[:, 0].float(), -1)
        a = torch.multinomial(logp_all.exp(), 1)
        lp = logp_all.gather(-1, a)[:, 0]
        actions[k] = a[:, 0]
        total = lp if total is None else total + lp
    assert total is not None, "the policy returned no action logits"
    return actions, total


class RolloutWorker:
    def __init__(self, rollout_manager: str, replay_buffer: str, model_registry: str, address: str = "",
                 env_backend: str | None = None, relay_port: int = 0, shelf: RelayShelf | None = None) -> None:
        self.manager = RolloutManagerClient(rollout_manager)
        self.config = self.manager.run_config()
        rc = self.config.rollout_config
        wc = rc.worker_config
        self.T, self.N = rc.fragment_length, wc.num_envs
        self.spaces, self.policy, _, _ = run_spaces(self.config)
        self.device = pick_device(wc.device, rc.num_gpus_per_worker)
        self.policy.to(self.device).eval()
        self.address = address
        reply = self.manager.register(self._register_request())
        self.worker_id, self.run_id, self.index = reply.worker_id, reply.run_id, reply.worker_index
        self.lease_seconds = reply.lease_seconds
        log.info("registered as %s (index %d) in run %s; inference on %s", self.worker_id, self.index, self.run_id,
                 self.device)
        self.stop_event = threading.Event()
        self._finish_by: float | None = None  # monotonic: finishing the fragments under way until then
        self.env_steps = 0
        self.fragments_completed = 0
        self.fragments_dropped = 0
        self.preempted_env_steps = 0  # stepped, then thrown away as the worker stopped
        self.model_version = 0
        self.steps_per_second = 0.0
        # What the manager has counted under earlier worker ids (a re-registration after a lost lease):
        # the heartbeats of the new id report only what came after, so nothing is counted twice.
        self._counted: dict[str, Any] = {"env_steps": 0, "fragments_sent": 0, "fragments_completed": 0,
                                           "room_wait_seconds": 0.0, "env_slot_seconds": 0.0,
                                           "preempted_env_steps": 0}
        self._acked = dict(self._counted)  # the counters of the last heartbeat the manager answered
        self._report_sequence = 0
        self._unacked_report: mpb.ReportEpisodesRequest | None = None
        self._leftover: list[common_pb2.Fragment] = []
        self.buffer = ReplayBufferClient(replay_buffer)
        self.sender = self.buffer.writer(rc.to_send_queue_size, os.environ.get("OVERWORLD_ACK_LOG"))
        self.has_room = np.zeros(self.N, np.bool_)  # the slot's current fragment took reserved room
        self.waiting_for_room = np.zeros(self.N, np.bool_)
        # Env-slot seconds waiting for room, and env-slot seconds in all since stepping began (idle share).
        self.room_wait_seconds = 0.0
        self.env_slot_seconds = 0.0
        self._slots_counted_at: float | None = None
        self.watcher = WeightsWatcher(model_registry, self.worker_id, self.policy.state_dict(), relay_port=relay_port,
                                      shelf=shelf)
        seed = self.config.seed * 1_000_003 + self.index * 10_007
        self.pool = make_pool(self.config, self.spaces, seed, env_backend)
        self.room = self.buffer.reservations(self.worker_id, on_room=self.pool.wake)
        self.cutter = FragmentCutter(self.spaces, self.N, self.T)
        ENV_SLOTS.labels(self.worker_id).set(self.N)
        task = self.config.task_name or self.config.env_generator.rsplit(":", 1)[-1]
        self.episodes = EpisodeTracker(self.N, self.config.train_config.discount, task)
        self.pipeline = PipelineReport(wc.log_interval, wc.moving_stat_duration, wc.max_fast_reset)
        self.video = VideoRecorder(image_key(self.spaces), wc.video_fps, self._upload_video)
        self.first = np.ones(self.N, np.bool_)
        self.state: dict[str, torch.Tensor] = {}
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._done = threading.Event()

    def _register_request(self) -> mpb.RegisterRequest:
        return mpb.RegisterRequest(hostname=socket.gethostname(), num_envs=self.N, spaces=self.spaces.to_proto(),
                                   address=self.address)

    # -- fleet -----------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = max(0.5, min(2.0, self.lease_seconds / 4))
        while not self._done.wait(interval):
            self._report()

    def _report(self) -> None:
        try:
            self._report_episodes()
            counters = {"env_steps": self.env_steps, "fragments_sent": self.sender.sent,
                        "fragments_completed": self.fragments_completed, "room_wait_seconds": self.room_wait_seconds,
                        "env_slot_seconds": self.env_slot_seconds, "preempted_env_steps": self.preempted_env_steps}
            reply = self.manager.heartbeat(mpb.HeartbeatRequest(
                worker_id=self.worker_id, **{k: v - self._counted[k] for k, v in counters.items()},
                model_version=self.model_version, env_steps_per_second=self.steps_per_second,
                env_restarts=self.pool.restarts_snapshot(), fragments_dropped=self.fragments_dropped,
                send_queue_depth=self.sender.depth(), envs_ready=int(self.pool.active.sum())))
            if reply.lease_valid:
                self._acked = counters
                if reply.video_request_id:
                    self.video.requested(reply.video_request_id)
            else:
                call_failed("rollout-manager.Heartbeat")
                log.warning("lease expired (worker too slow, or the manager lost its state); registering again")
                again = self.manager.register(self._register_request(), timeout=PERIODIC_TIMEOUT)
                ENV_SLOTS.remove(self.worker_id)
                self.worker_id = again.worker_id
                ENV_SLOTS.labels(self.worker_id).set(self.N)
                self.watcher.watcher_id = self.worker_id  # push acknowledgements follow the new id
                self.room.change_holder(self.worker_id, int(self.has_room.sum()))
                self.has_room[:] = False
                self._counted = self._acked  # the old id's record keeps what it was told
        except grpc.RpcError as err:
            attempt_again("rollout-manager.Heartbeat")  # the next one carries what this one had
            log.warning("rollout manager unreachable (%s)", err.code().name)
        QUEUE_DEPTH.set(self.sender.depth())

    def _report_episodes(self) -> None:
        """Finished episodes to the manager. A report is sent again unchanged, with its sequence number,
        until acknowledged (the manager ignores one it applied before): no episode lost or counted twice."""
        if self._unacked_report is None:
            episodes = self.episodes.take()
            if not episodes:
                return
            self._report_sequence += 1
            self._unacked_report = mpb.ReportEpisodesRequest(worker_id=self.worker_id, episodes=episodes,
                                                             report_sequence=self._report_sequence)
        try:
            self.manager.report_episodes(self._unacked_report)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise  # sent again next time
            log.error("rollout manager refused %d episodes: %s", len(self._unacked_report.episodes), err.details())
        self._unacked_report = None

    def _upload_video(self, chunks: list[mpb.VideoChunk]) -> mpb.VideoInfo:
        for c in chunks[:1]:
            c.info.worker_id = self.worker_id
        return self.manager.upload_video(chunks)

    # -- weights -----------------------------------------------------------------------------------
    def _swap_weights(self, pending: tuple[int, dict[str, torch.Tensor]] | None) -> None:
        if pending is None:
            return
        version, state = pending
        self.policy.load_state_dict(state)
        if self.model_version == 0:
            log.info("swapped in model version %d, the first", version)
        self.model_version = version
        MODEL_VERSION.labels(self.worker_id).set(version)
        self.watcher.ack(version)

    # -- inference ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _act(self, g: int, slots: np.ndarray) -> None:
        obs = {k: v[slots] for k, v in self.pool.obs.items()}  # a copy: the rows change while we wait
        first = self.first[slots]
        started = time.monotonic()
        idx = torch.as_tensor(slots, device=self.device)
        before = {k: v[idx] for k, v in self.state.items()}
        obs_t = {k: torch.as_tensor(v).to(self.device, non_blocking=True).unsqueeze(1) for k, v in obs.items()}
        first_t = torch.as_tensor(first).to(self.device).unsqueeze(1)
        out, after = self.policy(obs_t, before, first_t)
        sample = getattr(self.policy, "sample_actions", sample_with_log_prob)  # a MinePolicy: its pi_head.sample
        action_t, logp_t = sample(out.logits)
        logp = logp_t.cpu().numpy()
        value = self.policy.value(out)[:, 0].float().cpu().numpy()
        action = {k: v.cpu().numpy() for k, v in action_t.items()}
        INFER_BATCH.observe(len(slots))
        INFER_LATENCY.observe(time.monotonic() - started)
        self.pipeline.update("inference", time.monotonic() - started)
        for k, v in after.items():
            self.state[k][idx] = v
        starting = self.cutter.t[slots] == 0
        state_before = {k: v.cpu().numpy() for k, v in before.items()} if before and starting.any() else None
        self.cutter.record_action(slots, obs, action, first, logp, value, self.model_version, state_before)
        if self.video.slot is not None and self.video.key is not None:
            where = np.flatnonzero(slots == self.video.slot)
            if where.size:
                self.video.frame({self.video.slot: obs[self.video.key][where[0]]}, float(value[where[0]]))
        self.pool.send(g, slots, action)
        self.first[slots] = False

    @torch.no_grad()
    def _bootstrap_values(self, slots: np.ndarray) -> np.ndarray:
        """Value of the final observation of truncated episodes (with the state after the step)."""
        final = self.pool.final_obs
        idx = torch.as_tensor(slots, device=self.device)
        obs_t = {k: torch.as_tensor(v[slots]).to(self.device).unsqueeze(1) for k, v in final.items()}
        state = {k: v[idx] for k, v in self.state.items()}
        first = torch.zeros(len(slots), 1, dtype=torch.bool, device=self.device)
        out, _ = self.policy(obs_t, state, first)
        return self.policy.value(out)[:, 0].float().cpu().numpy()

    # -- results -----------------------------------------------------------------------------------
    def _consume(self, res: GroupResult) -> None:
        a = self.pool.arrays
        if res.stepped:
            slots = np.asarray(res.stepped, np.int64)
            reward = a["reward"][slots].copy()
            terminated = a["terminated"][slots].copy()
            truncated = a["truncated"][slots].copy()
            boot = np.zeros(len(slots), np.float32)
            if truncated.any():
                boot[truncated] = self._bootstrap_values(slots[truncated])
            self.episodes.stepped(slots, reward)
            complete = self.cutter.record_outcome(slots, reward, terminated, truncated, boot)
            for slot in complete:
                source = self.pool.final_obs if int(slot) in res.ended else self.pool.obs
                self._emit(int(slot), {k: v[slot] for k, v in source.items()})
            for slot, extras in res.ended.items():
                task = extras.pop(TASK_KEY, None)
                stats = self.episodes.ended(slot, self.model_version, extras, task)
                if slot == self.video.slot and self.video.key is not None:
                    self.video.finish(slot, self.pool.final_obs[self.video.key][slot], mpb.VideoInfo(
                        env_slot=slot, task=stats.task, sum_reward=stats.sum_reward, length=stats.length,
                        model_version=self.model_version))
            self.env_steps += len(slots)
            ENV_STEPS.labels(self.worker_id).inc(len(slots))
        for slot, reason in res.failed.items():
            if self.cutter.drop(slot):
                self.fragments_dropped += 1
                FRAGMENTS_DROPPED.labels(reason).inc()
            if self.has_room[slot]:
                self.room.unused(1)
                self.has_room[slot] = False
            self.waiting_for_room[slot] = False
            self.episodes.forget(slot)
            self.video.abort(slot)
        for slot in res.joined:
            self.first[slot] = True
            self.video.maybe_start(slot)

    def _emit(self, slot: int, next_obs: dict[str, np.ndarray]) -> None:
        sequence, data = self.cutter.take(slot, next_obs)
        self.has_room[slot] = False
        msg = Fragment(self.run_id, self.worker_id, slot, sequence, data).to_proto()
        self.fragments_completed += 1
        # blocked on backpressure (the buffer waiting on the trainer, or gone), new weights still go in
        if not self.sender.put(msg, self.stop_event, while_waiting=lambda: self._swap_weights(self.watcher.take())):
            self._leftover.append(msg)  # stopping with a full queue: flushed by shutdown()
            return
        FRAGMENTS_SENT.labels(self.worker_id).inc()
        POLICY_LAG.observe(max(0, self.watcher.version - int(data["model_version"][0])))

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        if self.device.type == "cpu":
            # MineStudio's num_cpus_per_worker: the worker's own share; the env processes need the rest
            torch.set_num_threads(max(1, int(self.config.rollout_config.num_cpus_per_worker)))
        self._heartbeat.start()
        self._swap_weights(self.watcher.wait_first(self.stop_event))
        if self.stop_event.is_set():
            return
        self.state = {k: v.to(self.device) for k, v in self.policy.initial_state(self.N).items()}
        groups = range(len(self.pool.groups))
        sent_at = [0.0] * len(self.pool.groups)  # > 0: the group has a step in flight
        rate_started, rate_steps = time.monotonic(), self.env_steps
        self._slots_counted_at = rate_started
        while not self.stop_event.is_set():
            if self._finish_by is not None and (not self.cutter.t.any() or time.monotonic() > self._finish_by):
                break
            self._count_slot_seconds()
            self._swap_weights(self.watcher.take())
            for g in groups:  # groups with nothing in flight: failures and joins, and envs that became ready
                if not sent_at[g]:
                    self._consume(self.pool.take(g))
                    sent_at[g] = self._act_on(g)
            flying = [g for g in groups if sent_at[g]]
            if not flying:
                self.pool.idle_wait(0.05)
                continue
            done = self.pool.wait_any(flying, 0.05, self.stop_event)
            if done is None or self.stop_event.is_set():
                continue
            STEP_LATENCY.observe(time.monotonic() - sent_at[done])
            self.pipeline.update("env_step", time.monotonic() - sent_at[done])
            self._consume(self.pool.take(done))
            sent_at[done] = self._act_on(done)
            if self.pipeline.log_interval is not None:
                self.pipeline.update("queue_size_after_inference", sum(int(self.pool.ready(x).size) for x in groups))
                self.pipeline.maybe_log()
            now = time.monotonic()
            if now - rate_started > 5:
                self.steps_per_second = (self.env_steps - rate_steps) / (now - rate_started)
                rate_started, rate_steps = now, self.env_steps

    def finish(self, seconds: float) -> None:
        """Begin no fragment; the loop returns once every fragment under way is complete (and sent) or
        after `seconds`. A stopping worker (a preempted pod, the end of a run) then throws away at most
        what could not be finished in time."""
        self._finish_by = time.monotonic() + seconds
        self.pool.wake()

    def _count_slot_seconds(self) -> None:
        """Env-slot seconds since the last count: all of them, and those of slots waiting for room."""
        now = time.monotonic()
        if self._slots_counted_at is None:
            return
        elapsed, self._slots_counted_at = now - self._slots_counted_at, now
        waited = elapsed * int(self.waiting_for_room.sum())
        self.room_wait_seconds += waited
        self.env_slot_seconds += elapsed * self.N
        ROOM_WAIT.labels(self.worker_id).inc(waited)

    def _act_on(self, g: int) -> float:
        """Act on the ready slots of group g that may step; when the step was sent (0.0: nothing to step)."""
        ready = self._with_room(self.pool.ready(g))
        if not ready.size:
            return 0.0
        self._act(g, ready)
        return time.monotonic()

    def _with_room(self, ready: np.ndarray) -> np.ndarray:
        """Of the ready slots, those mid-fragment and those starting a fragment that got room; the others
        wait for room. Room goes to the slots furthest into their episodes first, and a slot that would
        begin a new episode asks for room that no worker's episode under way waits for: the fleet
        finishes the episodes it began before it begins more (docs/replay_buffer.md)."""
        if self._finish_by is not None:
            self.waiting_for_room[:] = False
            return ready[self.cutter.t[ready] > 0]
        starting = ready[(self.cutter.t[ready] == 0) & ~self.has_room[ready]]
        if starting.size:
            starting = starting[np.lexsort((self.cutter.sequence[starting], -self.episodes.length[starting]))]
            granted = self.room.take(int(starting.size))
            self.has_room[starting[:granted]] = True
            self.waiting_for_room[starting[:granted]] = False
            self.waiting_for_room[starting[granted:]] = True
            waiting = int(self.waiting_for_room.sum())
            self.room.want(waiting, int((self.waiting_for_room & (self.episodes.length == 0)).sum()))
            SLOTS_WAITING_FOR_ROOM.set(waiting)
            if granted < starting.size:
                return ready[~np.isin(ready, starting[granted:])]
        return ready

    def shutdown(self, timeout: float = 30.0) -> None:
        """Flush every complete fragment, deregister, release the environments."""
        self.stop_event.set()
        self._count_slot_seconds()
        self._slots_counted_at = None
        partial_steps = int(self.cutter.t.sum())
        self.room.close(in_flight=int(self.has_room.sum()))  # partial fragments are not sent
        for msg in self._leftover:
            self.sender.put(msg, self.stop_event, force=True)
        self._leftover.clear()
        flushed = self.sender.close(timeout)
        unacknowledged = self.sender.depth()
        self.buffer.close()
        thrown_away = partial_steps + unacknowledged * self.T
        self.preempted_env_steps += thrown_away
        PREEMPTED_ENV_STEPS.inc(thrown_away)
        log.info("sender flushed: %s (%d complete fragments, %d acknowledged, %d rejected, %d partial dropped); "
                 "stopping threw away %d env steps (%d of partial fragments, %d fragments unacknowledged)",
                 flushed, self.fragments_completed, self.sender.sent, self.sender.rejected, self.fragments_dropped,
                 thrown_away, partial_steps, unacknowledged)
        self._done.set()
        self._report()
        try:
            self.manager.deregister(self.worker_id)
        except grpc.RpcError as err:
            log.warning("could not deregister: %s", err.code().name)
        self.watcher.close()
        self.pool.close()
