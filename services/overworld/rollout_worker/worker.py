"""The rollout worker: N environments, batched policy inference, fragments cut per env slot and
streamed to the replay buffer, new weights swapped in between batches."""

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
from prometheus_client import Counter, Gauge, Histogram

from overworld.core.config import RunConfig
from overworld.core.fragment import Fragment
from overworld.core.grpc_util import retry
from overworld.core.imports import call_generator, import_object
from overworld.core.specs import Spaces, TensorSpec, spaces_from_gym
from overworld.policies.base import Policy, log_prob, sample
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_worker.env_pool import EnvPool
from overworld.rollout_worker.sender import FragmentSender
from overworld.rollout_worker.weights import WeightsWatcher
from overworld.v1 import rollout_manager_pb2 as mpb

log = logging.getLogger("overworld.rollout_worker")

ENV_STEPS = Counter("overworld_env_steps_total", "Environment steps", ["worker"])
FRAGMENTS_SENT = Counter("overworld_fragments_sent_total", "Fragments handed to the sender", ["worker"])
POLICY_LAG = Histogram("overworld_fragment_policy_lag", "Model versions behind at send time",
                       buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32))
INFER_BATCH = Histogram("overworld_inference_batch_size", "Observations per inference call",
                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
INFER_LATENCY = Histogram("overworld_inference_latency_seconds", "Policy forward time",
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))
STEP_LATENCY = Histogram("overworld_env_step_latency_seconds", "Time to step all envs once",
                         buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
RESTARTS = Counter("overworld_env_restarts_total", "Environment restarts", ["reason"])
QUEUE_DEPTH = Gauge("overworld_send_queue_depth", "Fragments waiting to be sent or acknowledged")
MODEL_VERSION = Gauge("overworld_worker_model_version", "Model version in use", ["worker"])


def build_policy(config: RunConfig, observation_space: Any, action_space: Any) -> Policy:
    policy = call_generator(import_object(config.policy_generator), dict(config.policy_kwargs),
                            observation_space=observation_space, action_space=action_space)
    if not isinstance(policy, Policy):
        raise TypeError(f"{config.policy_generator} returned {type(policy).__name__}, not an overworld Policy "
                        "(wrap MineStudio policies with overworld.policies.minestudio)")
    policy.value_normalizer.enabled = config.train_config.use_normalized_vf
    return policy


def describe_env(config: RunConfig) -> tuple[Any, Any]:
    """Build one environment to read its spaces (no reset), then close it."""
    env = call_generator(import_object(config.env_generator), dict(config.env_kwargs))
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def run_spaces(config: RunConfig) -> tuple[Spaces, Policy, Any, Any]:
    obs_space, act_space = describe_env(config)
    policy = build_policy(config, obs_space, act_space)
    state = {k: TensorSpec(tuple(v.shape[1:]), str(v.dtype).removeprefix("torch."))
             for k, v in policy.initial_state(1).items()}
    return spaces_from_gym(obs_space, act_space, state), policy, obs_space, act_space


class RolloutWorker:
    def __init__(self, rollout_manager: str, replay_buffer: str, model_registry: str, address: str = "") -> None:
        self.manager = RolloutManagerClient(rollout_manager)
        self.config = self.manager.run_config()
        rc = self.config.rollout_config
        self.T = rc.fragment_length
        self.N = rc.worker_config.num_envs
        self.spaces, self.policy, _, _ = run_spaces(self.config)
        device = rc.worker_config.device
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        self.policy.to(self.device).eval()
        reply = retry(lambda: self.manager.stub.Register(mpb.RegisterRequest(
            hostname=socket.gethostname(), num_envs=self.N, spaces=self.spaces.to_proto(), address=address),
            timeout=10), "Register", 120)
        self.worker_id, self.run_id, self.index = reply.worker_id, reply.run_id, reply.worker_index
        self.lease_seconds = reply.lease_seconds
        log.info("registered as %s (index %d) in run %s on %s", self.worker_id, self.index, self.run_id, self.device)
        self.stop_event = threading.Event()
        self.env_steps = 0
        self.fragments_dropped = 0
        self.model_version = 0
        self.latest_seen_version = 0
        self.steps_per_second = 0.0
        self._episodes: list[mpb.EpisodeStats] = []
        self._episodes_lock = threading.Lock()
        self.sender = FragmentSender(replay_buffer, rc.to_send_queue_size)
        self.watcher = WeightsWatcher(model_registry, self.worker_id, self.policy.state_dict())
        seed = self.config.seed * 1_000_003 + self.index * 10_007
        self.pool = EnvPool(self.config.env_generator, dict(self.config.env_kwargs), self.spaces, self.N,
                            rc.worker_config.num_env_processes or min(self.N, os.cpu_count() or 1), seed)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._done = threading.Event()

    # -- fleet -----------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = max(0.5, min(2.0, self.lease_seconds / 4))
        while not self._done.wait(interval):
            self._report()

    def _report(self) -> None:
        with self._episodes_lock:
            episodes, self._episodes = self._episodes, []
        try:
            if episodes:
                self.manager.stub.ReportEpisodes(mpb.ReportEpisodesRequest(worker_id=self.worker_id,
                                                                           episodes=episodes), timeout=5)
            reply = self.manager.stub.Heartbeat(mpb.HeartbeatRequest(
                worker_id=self.worker_id, env_steps=self.env_steps, fragments_sent=self.sender.sent,
                model_version=self.model_version), timeout=5)
            if not reply.lease_valid:
                log.warning("lease expired (manager restarted or we were too slow); registering again")
                reply = self.manager.stub.Register(mpb.RegisterRequest(
                    hostname=socket.gethostname(), num_envs=self.N, spaces=self.spaces.to_proto()), timeout=10)
                self.worker_id = reply.worker_id
        except grpc.RpcError as err:
            with self._episodes_lock:
                self._episodes = episodes + self._episodes  # keep them for the next report
            log.warning("rollout manager unreachable (%s)", err.code().name)
        QUEUE_DEPTH.set(self.sender.depth())

    # -- weights -----------------------------------------------------------------------------
    def _swap_weights(self, pending: tuple[int, dict[str, torch.Tensor]] | None) -> None:
        if pending is None:
            return
        version, state = pending
        self.policy.load_state_dict(state)
        self.model_version = version
        MODEL_VERSION.labels(self.worker_id).set(version)
        self.watcher.ack(version)

    # -- the loop ----------------------------------------------------------------------------
    def _buffers(self) -> dict[str, np.ndarray]:
        N, T = self.N, self.T
        b: dict[str, np.ndarray] = {}
        for k, s in self.spaces.obs.items():
            b[f"obs.{k}"] = np.zeros((N, T, *s.shape), s.dtype)
        for k, s in self.spaces.action.items():
            b[f"action.{k}"] = np.zeros((N, T, *s.shape), s.dtype)
        for k, dtype in (("reward", np.float32), ("terminated", np.bool_), ("truncated", np.bool_),
                         ("first", np.bool_), ("logp", np.float32), ("value", np.float32),
                         ("bootstrap_value", np.float32), ("model_version", np.int64)):
            b[k] = np.zeros((N, T), dtype)
        return b

    @torch.no_grad()
    def _act(self, obs: dict[str, np.ndarray], state: dict[str, torch.Tensor], first: np.ndarray):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        obs_t = {k: torch.as_tensor(v, device=self.device).unsqueeze(1) for k, v in obs.items()}
        first_t = torch.as_tensor(first, device=self.device).unsqueeze(1)
        out, new_state = self.policy(obs_t, state, first_t)
        action = sample(out.logits)
        logp = log_prob(out.logits, action)
        value = self.policy.value(out)
        INFER_BATCH.observe(len(first))
        INFER_LATENCY.observe(time.monotonic() - started)
        return ({k: v[:, 0].cpu().numpy() for k, v in action.items()}, logp[:, 0].cpu().numpy(),
                value[:, 0].cpu().numpy(), new_state)

    @torch.no_grad()
    def _bootstrap_values(self, final_obs: dict[str, np.ndarray], state: dict[str, torch.Tensor],
                          mask: np.ndarray) -> np.ndarray:
        idx = np.flatnonzero(mask)
        obs_t = {k: torch.as_tensor(v[idx], device=self.device).unsqueeze(1) for k, v in final_obs.items()}
        st = {k: v[torch.as_tensor(idx, device=self.device)] for k, v in state.items()}
        first = torch.zeros(len(idx), 1, dtype=torch.bool, device=self.device)
        out, _ = self.policy(obs_t, st, first)
        values = np.zeros(self.N, np.float32)
        values[idx] = self.policy.value(out)[:, 0].cpu().numpy()
        return values

    def run(self) -> None:
        torch.set_num_threads(1)
        self._heartbeat.start()
        self._swap_weights(self.watcher.wait_first(self.stop_event))
        if self.stop_event.is_set():
            return
        discount = self.config.train_config.discount
        task = self.config.task_name or self.config.env_generator.rsplit(":", 1)[-1]
        obs = {k: v.copy() for k, v in self.pool.reset().items()}
        state = self.policy.initial_state(self.N)
        first = np.ones(self.N, np.bool_)
        ep_return = np.zeros(self.N)
        ep_discounted = np.zeros(self.N)
        ep_length = np.zeros(self.N, np.int64)
        sequence = 0
        buf = self._buffers()
        in_state = {k: v.clone() for k, v in state.items()}
        t = 0
        rate_started, rate_steps = time.monotonic(), 0
        while not self.stop_event.is_set():
            self._swap_weights(self.watcher.take())
            action, logp, value, new_state = self._act(obs, state, first)
            for k, v in obs.items():
                buf[f"obs.{k}"][:, t] = v
            for k, v in action.items():
                buf[f"action.{k}"][:, t] = v
            buf["first"][:, t] = first
            buf["logp"][:, t] = logp
            buf["value"][:, t] = value
            buf["model_version"][:, t] = self.model_version
            started = time.monotonic()
            result = self.pool.step(action)
            STEP_LATENCY.observe(time.monotonic() - started)
            buf["reward"][:, t] = result.reward
            buf["terminated"][:, t] = result.terminated
            buf["truncated"][:, t] = result.truncated
            buf["bootstrap_value"][:, t] = (self._bootstrap_values(result.final_obs, new_state, result.truncated)
                                            if result.truncated.any() else 0.0)
            ep_discounted += result.reward * discount ** ep_length
            ep_return += result.reward
            ep_length += 1
            done = result.terminated | result.truncated
            for slot in np.flatnonzero(done):
                with self._episodes_lock:
                    self._episodes.append(mpb.EpisodeStats(
                        task=task, sum_reward=float(ep_return[slot]), discounted_reward=float(ep_discounted[slot]),
                        length=int(ep_length[slot]), model_version=self.model_version,
                        extras=result.episode_infos.get(int(slot), {})))
            ep_return[done] = 0.0
            ep_discounted[done] = 0.0
            ep_length[done] = 0
            obs = {k: v.copy() for k, v in result.obs.items()}
            state, first = new_state, done
            t += 1
            self.env_steps += self.N
            rate_steps += self.N
            ENV_STEPS.labels(self.worker_id).inc(self.N)
            if t == self.T:
                self._emit(buf, obs, in_state, sequence)
                sequence += 1
                in_state = {k: v.clone() for k, v in state.items()}
                t = 0
                now = time.monotonic()
                if now - rate_started > 5:
                    self.steps_per_second = rate_steps / (now - rate_started)
                    rate_started, rate_steps = now, 0

    def _emit(self, buf: dict[str, np.ndarray], next_obs: dict[str, np.ndarray],
              in_state: dict[str, torch.Tensor], sequence: int) -> None:
        for slot in range(self.N):
            data = {k: v[slot].copy() for k, v in buf.items()}
            for k, v in next_obs.items():
                data[f"next_obs.{k}"] = v[slot:slot + 1].copy()
            for k, v in in_state.items():
                data[f"state.{k}"] = v[slot].cpu().numpy()
            fragment = Fragment(self.run_id, self.worker_id, slot, sequence, data)
            if not self.sender.put(fragment.to_proto(), self.stop_event):
                self.fragments_dropped += self.N - slot
                return
            FRAGMENTS_SENT.labels(self.worker_id).inc()
            POLICY_LAG.observe(max(0, self.watcher.version - int(data["model_version"][0])))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Flush complete fragments, deregister, release the environments."""
        self.stop_event.set()
        flushed = self.sender.close(timeout)
        log.info("sender flushed: %s (%d sent, %d rejected)", flushed, self.sender.sent, self.sender.rejected)
        self._done.set()
        self._report()
        try:
            self.manager.stub.Deregister(mpb.DeregisterRequest(worker_id=self.worker_id), timeout=5)
        except grpc.RpcError as err:
            log.warning("could not deregister: %s", err.code().name)
        self.watcher.close()
        self.pool.close()
