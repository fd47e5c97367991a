"""The environments of a set of slots, as one env process (or the in-process backend) runs them.

`step(slots)` steps the slots the worker marked in `act` and writes the outcomes into the slot
arrays. A finished episode leaves its slot *inactive*: the final observation goes to `final_obs`,
and the reset happens off the hot path, on this runner's reset thread, while the other slots keep
stepping (Crafter's world generation takes 20-300 ms, Minecraft's reset far longer). When the reset is done the runner
writes the new observation into the slot's `obs` row and announces the slot as *joined*; only
then may the worker act on it again. Resets that prove cheap (< 2 ms, CartPole) run inline.

An env whose `step` or `reset` raises is closed and rebuilt on the reset thread (reported as an
`error` restart); `restart_interval` rebuilds an env between episodes once it is that old. A slot
whose rebuild keeps failing makes the runner `fatal`, and the worker restarts the whole process.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("overworld.rollout_worker.env")

CHEAP_RESET_SECONDS = 0.002
MAX_CONSECUTIVE_FAILURES = 3
Announce = Callable[[list[int]], None]


def reset_env(env: Any, seed: int | None) -> Any:
    """gymnasium's reset(seed=...) -> (obs, info); MineStudio's reset() takes no seed; old gym returns obs."""
    try:
        takes_seed = "seed" in inspect.signature(env.reset).parameters
    except (TypeError, ValueError):
        takes_seed = False
    out = env.reset(seed=seed) if takes_seed and seed is not None else env.reset()
    return out[0] if isinstance(out, tuple) else out


def step_env(env: Any, action: Any) -> tuple[Any, float, bool, bool, Any]:
    out = env.step(action)
    if len(out) == 5:
        obs, reward, terminated, truncated, info = out
    else:  # old gym: (obs, reward, done, info)
        obs, reward, done, info = out
        truncated = bool(isinstance(info, dict) and info.get("TimeLimit.truncated", False))
        terminated = bool(done) and not truncated
    return obs, float(reward), bool(terminated), bool(truncated), info


TASK_KEY = "task"


def episode_extras(info: Any) -> dict[str, Any]:
    """Numbers reported with an episode: Crafter-style `achievements` and an optional `episode_extras`
    dict; and under TASK_KEY the episode's task label when the env gives a string `info["task"]`
    (MineStudio's obs["task"], moved there by envs/minestudio.py)."""
    out: dict[str, Any] = {}
    if not isinstance(info, dict):
        return out
    if isinstance(info.get(TASK_KEY), str):
        out[TASK_KEY] = info[TASK_KEY]
    for key in ("achievements", "episode_extras"):
        values = info.get(key)
        if isinstance(values, dict):
            for k, v in values.items():
                if isinstance(v, int | float | bool | np.number) and np.isfinite(float(v)):
                    out[str(k)] = float(v)
    return out


class EnvRunner:
    def __init__(self, make_env: Callable[[], Any], slots: list[int], seeds: dict[int, int],
                 arrays: dict[str, np.ndarray], restart_interval: float | None, background: bool,
                 announce: Announce | None = None) -> None:
        self.make_env = make_env
        self.slots = list(slots)
        self.seeds = seeds
        self.a = arrays
        self.obs_keys = sorted(k[4:] for k in arrays if k.startswith("obs."))
        self.action_keys = sorted(k[7:] for k in arrays if k.startswith("action."))
        self.restart_interval = restart_interval or None
        self.background = background
        self.announce = announce  # background joins are announced through this (the env process' pipe)
        self.envs: dict[int, Any] = {}
        self.created: dict[int, float] = {}
        self.builds: dict[int, int] = dict.fromkeys(self.slots, 0)
        self.failures: dict[int, int] = dict.fromkeys(self.slots, 0)
        self.active: set[int] = set()
        self.fatal: str | None = None
        self.reset_seconds = 1.0  # EWMA; starts "expensive" so the first resets go to the thread
        self._joined: list[int] = []  # inline joins, reported with the current reply
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[int, bool] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._job_loop, name="env-resets", daemon=True)
            self._thread.start()

    # -- building and resetting ---------------------------------------------------------------
    def start(self) -> None:
        for slot in self.slots:
            self._schedule(slot, rebuild=True)

    def _schedule(self, slot: int, rebuild: bool) -> None:
        if self.background and (rebuild or self.reset_seconds >= CHEAP_RESET_SECONDS):
            self._jobs.put((slot, rebuild))
        else:
            self._prepare(slot, rebuild)
            if slot in self.active:
                self._joined.append(slot)

    def _prepare(self, slot: int, rebuild: bool) -> None:
        """Build (if asked) and reset the env of `slot`, write its observation, mark it active."""
        while True:
            try:
                if rebuild or slot not in self.envs:
                    old = self.envs.pop(slot, None)
                    if old is not None:
                        try:
                            old.close()
                        except Exception:  # noqa: BLE001 - a broken env may not even close
                            log.debug("closing the broken env of slot %d failed", slot, exc_info=True)
                    self.envs[slot] = self.make_env()
                    self.created[slot] = time.monotonic()
                    self.builds[slot] += 1
                    seed: int | None = self.seeds[slot] + 1_000_003 * (self.builds[slot] - 1)
                else:
                    seed = None
                started = time.monotonic()
                obs = reset_env(self.envs[slot], seed)
                self.reset_seconds = 0.8 * self.reset_seconds + 0.2 * (time.monotonic() - started)
                self._write("obs", slot, obs)
                self.failures[slot] = 0
                with self._lock:
                    self.active.add(slot)
                return
            except Exception as err:  # noqa: BLE001 - any env error is survivable once
                self.failures[slot] += 1
                log.error("env of slot %d failed to build/reset (%d in a row): %s\n%s", slot, self.failures[slot],
                          err, traceback.format_exc())
                if self.failures[slot] >= MAX_CONSECUTIVE_FAILURES:
                    self.fatal = f"slot {slot}: env failed {self.failures[slot]} times in a row: {err!r}"
                    return
                rebuild = True

    def _job_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot, rebuild = job
            try:
                self._prepare(slot, rebuild)
                if self.fatal is not None:
                    if self.announce is not None:
                        self.announce([])  # wakes the parent, which reads `fatal` with the message
                    return
                if self.announce is not None:
                    self.announce([slot])
            finally:
                self._jobs.task_done()

    def wait_idle(self, timeout: float) -> bool:
        """Until every queued reset is done (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._jobs.unfinished_tasks

    # -- stepping -------------------------------------------------------------------------------
    def _write(self, prefix: str, slot: int, obs: Any) -> None:
        if not isinstance(obs, dict):
            obs = {self.obs_keys[0]: obs}
        for k in self.obs_keys:
            self.a[f"{prefix}.{k}"][slot] = obs[k]

    def _action(self, slot: int) -> Any:
        def value(k: str) -> Any:
            v = self.a[f"action.{k}"][slot]
            return v.item() if v.ndim == 0 else v.copy()

        if self.action_keys == ["action"]:
            return value("action")
        return {k: value(k) for k in self.action_keys}

    def step(self, slots: list[int]) -> dict[str, Any]:
        """Step the slots among `slots` that the worker marked in `act`. Returns the reply:
        stepped, ended {slot: extras}, errors {slot: reason}, recycled, joined (inline resets)."""
        stepped: list[int] = []
        ended: dict[int, dict[str, Any]] = {}  # episode_extras: numbers, and the task label
        errors: dict[int, str] = {}
        recycled: list[int] = []
        a = self.a
        for slot in slots:
            if not a["act"][slot]:
                continue
            if slot not in self.active:
                errors[slot] = "error"  # the worker acted on a slot we do not consider live
                continue
            try:
                obs, reward, terminated, truncated, info = step_env(self.envs[slot], self._action(slot))
            except Exception as err:  # noqa: BLE001
                log.error("env of slot %d raised in step: %r\n%s", slot, err, traceback.format_exc())
                with self._lock:
                    self.active.discard(slot)
                errors[slot] = "error"
                self._schedule(slot, rebuild=True)
                continue
            a["reward"][slot] = reward
            a["terminated"][slot] = terminated
            a["truncated"][slot] = truncated and not terminated
            stepped.append(slot)
            if terminated or truncated:
                self._write("final_obs", slot, obs)
                ended[slot] = episode_extras(info)
                with self._lock:
                    self.active.discard(slot)
                old = self.restart_interval is not None and \
                    time.monotonic() - self.created[slot] > self.restart_interval
                if old:
                    recycled.append(slot)
                self._schedule(slot, rebuild=old)
            else:
                self._write("obs", slot, obs)
        return {"stepped": stepped, "ended": ended, "errors": errors, "recycled": recycled,
                "joined": self.take_joined()}

    def take_joined(self) -> list[int]:
        """Slots whose inline reset finished since the last call (their obs rows are written)."""
        joined, self._joined = self._joined, []
        return joined

    def close(self) -> None:
        if self._thread is not None:
            while True:  # drop queued resets: we are leaving
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
            self._jobs.put(None)
            self._thread.join(5)
        for env in self.envs.values():
            try:
                env.close()
            except Exception:  # noqa: BLE001
                log.debug("env close failed", exc_info=True)
