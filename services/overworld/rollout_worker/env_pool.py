"""N environment slots in G groups, stepped asynchronously so that the policy's inference on one
group overlaps the stepping of the other(s).

Protocol per group g: the worker reads `ready(g)` (slots with an observation to act on), writes
their actions into the slot arrays and calls `send(g, slots, actions)`; later `wait_any(groups)`
names a group whose step is answered and `take(g)` returns its `GroupResult` (stepped slots with
reward/terminated/truncated in the arrays, ended episodes, slots that joined after a reset, slots
that failed). Observations live in shared memory and are never pickled; a step command is two
bytes, a reply a short JSON line.

Backends: `EnvPool` (spawned env processes; the default) and `InProcessEnvPool` (every env in the
worker's own process, stepped when sent: for envs so cheap that a process hop costs more than the
step, such as CartPole).

Faults (EnvPool): an env that raises is rebuilt inside its process (reason `error`); a process that
dies (`died`), misses `step_timeout` on a step or leaves a slot without a reset for
`4 * step_timeout` (`timeout`) is killed and started again (backoff 0.5, 1, 2 ... 30 s while it keeps
dying within a minute of its start); its slots are reported failed, the other processes go on. `restart_interval` rebuilds an
env between episodes (`interval`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing as mp
import os
import select
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from overworld.core.imports import call_generator, import_object
from overworld.core.specs import Spaces
from overworld.envs.minestudio import adapt_env
from overworld.rollout_worker import env_process
from overworld.rollout_worker.env_runner import EnvRunner
from overworld.rollout_worker.metrics import ENV_RESTARTS
from overworld.rollout_worker.shm import SharedArrays, layout, local_arrays

log = logging.getLogger("overworld.rollout_worker.env_pool")

MAX_DEATHS_BEFORE_HELLO = 5


@dataclass
class GroupResult:
    group: int
    stepped: list[int] = field(default_factory=list)
    ended: dict[int, dict[str, Any]] = field(default_factory=dict)  # episode_extras: numbers, and the task
    failed: dict[int, str] = field(default_factory=dict)  # slot -> reason; its episode is lost
    joined: list[int] = field(default_factory=list)  # slots starting an episode (obs written)
    recycled: list[int] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.stepped or self.failed or self.joined)


def group_slots(num_envs: int, num_groups: int) -> list[np.ndarray]:
    return [g for g in np.array_split(np.arange(num_envs), max(1, min(num_groups, num_envs))) if g.size]


class _PoolBase:
    def __init__(self, spaces: Spaces, num_envs: int, num_groups: int) -> None:
        self.spaces = spaces
        self.num_envs = num_envs
        self.groups = group_slots(num_envs, num_groups)
        self.group_of = np.zeros(num_envs, np.int64)
        for g, slots in enumerate(self.groups):
            self.group_of[slots] = g
        self.active = np.zeros(num_envs, np.bool_)
        self.inactive_since = np.full(num_envs, time.monotonic())
        self.restarts: Counter[str] = Counter()
        self._restarts_lock = threading.Lock()  # the heartbeat thread reads them
        self._pending = [GroupResult(g) for g in range(len(self.groups))]
        self.arrays: dict[str, np.ndarray] = {}
        # wake(): another thread has news for the loop (room reserved): its wait ends at once
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._woken = False
        self._wake_fds_open = True
        self._wake_lock = threading.Lock()  # a wake() racing close() never writes to a reused descriptor

    def wake(self) -> None:
        """End the loop's current wait (`idle_wait`, `wait_any`) now; callable from any thread."""
        with self._wake_lock, contextlib.suppress(BlockingIOError):  # a full pipe already wakes the loop
            if self._wake_fds_open:
                os.write(self._wake_write, b"\0")

    def _drain_wake(self) -> bool:
        """Whether wake() was called since the last drain."""
        try:
            woken = bool(os.read(self._wake_read, 4096))
        except BlockingIOError:
            woken = False
        self._woken = self._woken or woken
        return woken

    def _take_woken(self) -> bool:
        woken, self._woken = self._woken or self._drain_wake(), False
        return woken

    def _close_wake(self) -> None:
        """Once: a second close of a number the process has given to another file would close that one."""
        with self._wake_lock:
            fds, self._wake_fds_open = (self._wake_read, self._wake_write) if self._wake_fds_open else (), False
            for fd in fds:
                os.close(fd)

    @property
    def obs(self) -> dict[str, np.ndarray]:
        return {k: self.arrays[f"obs.{k}"] for k in self.spaces.obs}

    @property
    def final_obs(self) -> dict[str, np.ndarray]:
        return {k: self.arrays[f"final_obs.{k}"] for k in self.spaces.obs}

    def ready(self, g: int) -> np.ndarray:
        slots = self.groups[g]
        return slots[self.active[slots]]

    def _write_actions(self, g: int, slots: np.ndarray, action: dict[str, np.ndarray]) -> None:
        for k, v in action.items():
            self.arrays[f"action.{k}"][slots] = v
        act = self.arrays["act"]
        act[self.groups[g]] = False
        act[slots] = True

    def _count_restarts(self, reason: str, n: int) -> None:
        if n:
            with self._restarts_lock:
                self.restarts[reason] += n
            ENV_RESTARTS.labels(reason).inc(n)

    def restarts_snapshot(self) -> dict[str, int]:
        with self._restarts_lock:
            return dict(self.restarts)

    def _deactivate(self, slot: int) -> None:
        if self.active[slot]:
            self.active[slot] = False
            self.inactive_since[slot] = time.monotonic()

    def _on_message(self, msg: dict[str, Any]) -> None:
        """A step reply and/or joins, in the order the env process produced them."""
        if "group" in msg:
            r = self._pending[int(msg["group"])]
            r.stepped.extend(int(s) for s in msg["stepped"])
            for s, extras in msg["ended"].items():
                r.ended[int(s)] = extras
                self._deactivate(int(s))
            for s, reason in msg["errors"].items():
                r.failed[int(s)] = reason
                self._deactivate(int(s))
            self._count_restarts("error", len(msg["errors"]))
            r.recycled.extend(int(s) for s in msg["recycled"])
            self._count_restarts("interval", len(msg["recycled"]))
        for s in msg.get("joined", ()):
            s = int(s)
            self.active[s] = True
            self._pending[int(self.group_of[s])].joined.append(s)

    def take(self, g: int) -> GroupResult:
        """What happened to group g since the last take (steps, ended episodes, failures, joins)."""
        result, self._pending[g] = self._pending[g], GroupResult(g)
        return result

    def idle_wait(self, timeout: float) -> None:
        """Nothing to step: wait up to `timeout`, or until wake()."""
        if not self._take_woken():
            select.select([self._wake_read], [], [], max(0.0, timeout))
            self._take_woken()


class InProcessEnvPool(_PoolBase):
    """Every env in this process, stepped synchronously in `send` (no overlap, no process hop)."""

    def __init__(self, env_ref: str, env_kwargs: dict[str, Any], spaces: Spaces, num_envs: int, num_groups: int,
                 seed: int, restart_interval: float | None = None) -> None:
        super().__init__(spaces, num_envs, num_groups)
        self.arrays = local_arrays(layout(spaces), num_envs)
        generator = import_object(env_ref)
        self.runner = EnvRunner(lambda: adapt_env(call_generator(generator, dict(env_kwargs))), list(range(num_envs)),
                                {s: seed + s for s in range(num_envs)}, self.arrays, restart_interval,
                                background=False)
        self.runner.start()
        self._check()
        self._on_message({"joined": self.runner.take_joined()})
        for r in self._pending:
            r.joined.clear()  # the worker starts every slot with first=True anyway
        self._sent: list[int] = []  # groups in the order they were last sent

    def _check(self) -> None:
        if self.runner.fatal:
            raise RuntimeError(f"environment failed: {self.runner.fatal}")

    def send(self, g: int, slots: np.ndarray, action: dict[str, np.ndarray]) -> None:
        self._write_actions(g, slots, action)
        reply = self.runner.step([int(s) for s in self.groups[g]])
        self._check()
        self._on_message({"group": g, **reply})
        if g in self._sent:
            self._sent.remove(g)
        self._sent.append(g)

    def wait_any(self, groups: list[int], timeout: float, stop: threading.Event | None = None) -> int | None:
        """Every group sent has stepped already (send() is synchronous): the one sent longest ago, so that
        each group gets its turn (the first in the list, every time, starved the others)."""
        return next((g for g in self._sent if g in groups), groups[0] if groups else None)

    def close(self) -> None:
        self.runner.close()
        self._close_wake()


@dataclass
class _Proc:
    index: int
    slots: list[int]
    groups: dict[int, list[int]]
    proc: Any = None
    conn: Connection | None = None
    state: str = "down"  # down | starting | running
    outstanding: deque = field(default_factory=deque)  # groups with a step command in flight, in order
    head_since: float = 0.0  # when the oldest outstanding command became the one being worked on
    started_at: float = 0.0
    respawn_at: float = 0.0
    generation: int = 0
    deaths_before_hello: int = 0
    readable: Any = None  # select.poll() on conn alone: "another message?" without building a selector
    backoff: float = 0.0
    fatal: str = ""


class EnvPool(_PoolBase):
    def __init__(self, env_ref: str, env_kwargs: dict[str, Any], spaces: Spaces, num_envs: int, num_processes: int,
                 num_groups: int, seed: int, step_timeout: float = 60.0, restart_interval: float | None = None,
                 reset_timeout: float | None = None) -> None:
        super().__init__(spaces, num_envs, num_groups)
        self.env_ref, self.env_kwargs, self.seed = env_ref, dict(env_kwargs), seed
        self.step_timeout = step_timeout
        self.reset_timeout = reset_timeout or 4 * step_timeout
        self.restart_interval = restart_interval
        self.spec = layout(spaces)
        self.shared = SharedArrays(self.spec, num_envs)
        self.arrays = self.shared.arrays
        self.ctx = mp.get_context("spawn")
        n = max(1, min(num_processes or num_envs, num_envs))
        # With at least two groups per process, each group lives whole in one process: a process then
        # never waits for another one's step before the policy answers it (about a fifth faster on
        # Crafter). With fewer groups, slot s lives in process s mod n and a group spans processes.
        self.process_local_groups = len(self.groups) >= 2 * n
        self.procs: list[_Proc] = []
        owner = self.group_of if self.process_local_groups else np.arange(num_envs)
        for i in range(n):
            slots = [s for s in range(num_envs) if int(owner[s]) % n == i]
            groups = {g: [s for s in slots if self.group_of[s] == g] for g in range(len(self.groups))}
            self.procs.append(_Proc(i, slots, {g: v for g, v in groups.items() if v}))
        self._proc_of = np.zeros(num_envs, np.int64)
        for p in self.procs:
            self._proc_of[p.slots] = p.index
        # One poll set for every live process' pipe and sentinel, kept across calls: multiprocessing's
        # wait() and Connection.poll() build a selector per call, which cost as much as a small step.
        self._poller = select.poll()
        self._poller.register(self._wake_read, select.POLLIN)
        self._fd_owner: dict[int, _Proc] = {}
        for p in self.procs:
            self._spawn(p)

    # -- process lifecycle ---------------------------------------------------------------------
    def _spawn(self, p: _Proc) -> None:
        parent, child = self.ctx.Pipe()
        seeds = {s: self.seed + s + 7919 * p.generation for s in p.slots}
        p.proc = self.ctx.Process(target=env_process.main, name=f"env-process-{p.index}", daemon=True, args=(
            child, self.env_ref, self.env_kwargs, p.slots, p.groups, seeds, self.spec, self.num_envs,
            self.shared.names, self.restart_interval))
        p.proc.start()
        child.close()
        p.conn, p.state, p.started_at, p.fatal = parent, "starting", time.monotonic(), ""
        p.readable = select.poll()
        p.readable.register(parent.fileno(), select.POLLIN)
        for fd in (parent.fileno(), p.proc.sentinel):
            self._poller.register(fd, select.POLLIN)
            self._fd_owner[fd] = p
        p.outstanding.clear()
        p.generation += 1
        now = time.monotonic()
        self.inactive_since[p.slots] = now

    def _fail(self, p: _Proc, reason: str) -> None:
        """Kill the process; its slots fail (their partial fragments are dropped); respawn later."""
        if p.state == "down":
            return
        if p.fatal:
            reason = "error"
        log.warning("env process %d (pid %s, slots %s) %s%s; restarting it", p.index, p.proc.pid if p.proc else "?",
                    p.slots, {"timeout": "timed out", "died": "died"}.get(reason, "failed"),
                    f": {p.fatal}" if p.fatal else "")
        if p.state == "starting":
            p.deaths_before_hello += 1
            if p.deaths_before_hello >= MAX_DEATHS_BEFORE_HELLO:
                raise RuntimeError(f"env process {p.index} died {p.deaths_before_hello} times before starting; "
                                   f"is the env generator {self.env_ref!r} importable?")
        for fd in [fd for fd, owner in self._fd_owner.items() if owner is p]:
            self._poller.unregister(fd)
            del self._fd_owner[fd]
        if p.proc is not None and p.proc.is_alive():
            p.proc.kill()
        if p.proc is not None:
            p.proc.join(2)
        if p.conn is not None:
            p.conn.close()
        p.conn, p.state = None, "down"
        p.outstanding.clear()
        healthy = time.monotonic() - p.started_at > 60
        p.backoff = 0.0 if healthy else (min(30.0, p.backoff * 2) if p.backoff else 0.5)
        p.respawn_at = time.monotonic() + p.backoff
        for s in p.slots:
            self._deactivate(s)
            self._pending[int(self.group_of[s])].failed[s] = reason
        self.arrays["act"][p.slots] = False
        self._count_restarts(reason, len(p.slots))

    def _maintain(self) -> None:
        now = time.monotonic()
        for p in self.procs:
            if p.state == "down" and now >= p.respawn_at:
                self._spawn(p)
            elif p.state == "starting" and now - p.started_at > self.reset_timeout:
                self._fail(p, "timeout")
            elif p.state == "running":
                idle = [s for s in p.slots if not self.active[s] and now - self.inactive_since[s] > self.reset_timeout]
                if idle:
                    log.warning("slots %s got no reset for %.0fs", idle, self.reset_timeout)
                    self._fail(p, "timeout")

    def _handle(self, p: _Proc, raw: bytes) -> None:
        msg = json.loads(raw)
        if "hello" in msg:
            p.state, p.deaths_before_hello = "running", 0
            return
        if "group" in msg:
            g = int(msg["group"])
            if p.outstanding and p.outstanding[0] == g:
                p.outstanding.popleft()
                p.head_since = time.monotonic()
        self._on_message(msg)
        if "fatal" in msg:
            p.fatal = str(msg["fatal"])
            self._fail(p, "error")

    def _pump(self, timeout: float) -> None:
        """Read every message that is there (waiting up to `timeout` for the first one)."""
        if not self._fd_owner:
            time.sleep(max(0.0, timeout))
            return
        events = self._poller.poll(max(0.0, timeout) * 1000.0)
        touched: dict[int, bool] = {}  # proc index -> its process is gone
        for fd, _ in events:
            if fd == self._wake_read:
                self._drain_wake()
                continue
            p = self._fd_owner.get(fd)
            if p is not None:
                touched[p.index] = touched.get(p.index, False) or fd == p.proc.sentinel
        for index, died in touched.items():
            p = self.procs[index]
            try:  # every message that is there, also those a dying process wrote before it went
                while p.state != "down" and p.conn is not None and p.readable.poll(0):
                    self._handle(p, p.conn.recv_bytes())
            except (EOFError, OSError):
                died = True
            if died and p.state != "down":
                self._fail(p, "died")

    # -- the step protocol -----------------------------------------------------------------------
    def send(self, g: int, slots: np.ndarray, action: dict[str, np.ndarray]) -> None:
        self._write_actions(g, slots, action)
        now = time.monotonic()
        for index in set(self._proc_of[slots].tolist()):
            p = self.procs[index]
            if p.state != "running" or p.conn is None:
                continue
            try:
                p.conn.send_bytes(env_process.STEP + bytes([g]))
            except (BrokenPipeError, OSError):
                self._fail(p, "died")
                continue
            if not p.outstanding:
                p.head_since = now
            p.outstanding.append(g)

    def wait_any(self, groups: list[int], timeout: float, stop: threading.Event | None = None) -> int | None:
        """The first of `groups` (each with a step in flight) that every process answered (or failed), waiting
        up to `timeout`; None if none did by then. Taking groups in the order they finish, not round-robin,
        keeps a process that is done from waiting on a slower one."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            for p in self.procs:
                if p.state == "running" and p.outstanding and now - p.head_since > self.step_timeout:
                    log.warning("env process %d: no answer in %.1fs (step_timeout)", p.index, self.step_timeout)
                    self._fail(p, "timeout")
            busy = {g for p in self.procs if p.state == "running" for g in p.outstanding}
            done = next((g for g in groups if g not in busy), None)
            if done is not None or now >= deadline or (stop is not None and stop.is_set()) or self._take_woken():
                self._maintain()
                return done
            heads = [p.head_since + self.step_timeout for p in self.procs if p.state == "running" and p.outstanding]
            self._pump(max(0.0, min(deadline, *heads) - now) if heads else deadline - now)

    def idle_wait(self, timeout: float) -> None:
        """Nothing to step: wait for a join (or anything else) from any process, or wake()."""
        if not self._take_woken():
            self._pump(timeout)
            self._take_woken()
        self._maintain()

    def close(self) -> None:
        for p in self.procs:
            if p.conn is not None:
                with contextlib.suppress(BrokenPipeError, OSError):
                    p.conn.send_bytes(env_process.CLOSE)
        deadline = time.monotonic() + 5
        for p in self.procs:
            if p.proc is not None:
                p.proc.join(max(0.1, deadline - time.monotonic()))
                if p.proc.is_alive():
                    p.proc.kill()
                    p.proc.join(1)
            if p.conn is not None:
                p.conn.close()
        self.shared.close(unlink=True)
        self._close_wake()


def num_groups_for(num_envs: int, batch_size: int) -> int:
    """Groups of at most `batch_size` envs, and at least two so that inference overlaps stepping."""
    if num_envs < 2:
        return 1
    return max(2, math.ceil(num_envs / max(1, batch_size)))
