"""The env pool on its own: real spawned env processes, shared memory, faults."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from overworld.core.specs import spaces_from_gym
from overworld.rollout_worker.env_pool import EnvPool, GroupResult, InProcessEnvPool, num_groups_for
from tests.rollout_worker import faulty_envs

# A file path, not `tests.rollout_worker...`: in the spawned env processes `tests` would resolve to
# the `tests` package that opensimplex (a Crafter dependency) installs into site-packages.
ENVS = str(Path(faulty_envs.__file__).resolve())
SPACES = spaces_from_gym(faulty_envs.Counting().observation_space, faulty_envs.Counting().action_space)


def drive(pool, seconds: float, until=None) -> dict:  # type: ignore[no-untyped-def]
    """Step like the worker does (random actions) and tally what happened."""
    tally: dict = {"stepped": Counter(), "ended": 0, "failed": Counter(), "joined": 0, "overlap": 0, "results": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        progressed = False
        for g in range(len(pool.groups)):
            while pool.wait_any([g], 0.5) is None:
                pass
            res: GroupResult = pool.take(g)
            tally["results"] += 1
            for s in res.stepped:
                tally["stepped"][s] += 1
                assert np.isfinite(pool.arrays["reward"][s])
            tally["ended"] += len(res.ended)
            tally["failed"].update(res.failed.values())
            tally["joined"] += len(res.joined)
            if res.stepped and not pool.active.all():
                tally["overlap"] += 1  # some slots stepped while others were resetting/restarting
            ready = pool.ready(g)
            if ready.size:
                pool.send(g, ready, {"action": np.random.randint(0, 2, ready.size)})
                progressed = True
            progressed |= not res.empty()
        if not progressed:
            pool.idle_wait(0.02)
        if until is not None and until(tally):
            break
    return tally


def test_groups() -> None:
    assert num_groups_for(16, 8) == 2 and num_groups_for(16, 16) == 2 and num_groups_for(16, 4) == 4
    assert num_groups_for(1, 8) == 1


def cartpole_pool(backend: str, num_envs: int, num_groups: int) -> EnvPool | InProcessEnvPool:
    from overworld.envs.gym_tasks import make_env

    env = make_env("CartPole-v1")
    spaces = spaces_from_gym(env.observation_space, env.action_space)
    if backend == "subprocess":
        return EnvPool("overworld.envs.gym_tasks:make_env", {"id": "CartPole-v1"}, spaces, num_envs, 2, num_groups,
                       seed=0)
    return InProcessEnvPool("overworld.envs.gym_tasks:make_env", {"id": "CartPole-v1"}, spaces, num_envs, num_groups,
                            seed=0)


@pytest.mark.parametrize("backend", ["subprocess", "inprocess"])
def test_cartpole_steps_every_slot(backend: str) -> None:
    pool = cartpole_pool(backend, 4, 2)
    try:
        tally = drive(pool, 20, until=lambda t: t["ended"] >= 8 and len(t["stepped"]) == 4
                      and min(t["stepped"].values()) > 50)
        assert tally["ended"] >= 8 and sorted(tally["stepped"]) == [0, 1, 2, 3]
        assert not tally["failed"] and np.isfinite(pool.obs["obs"]).all()
    finally:
        pool.close()


@pytest.mark.parametrize(("num_groups", "local"), [(2, False), (4, True)])
def test_groups_live_whole_in_one_process_when_every_process_holds_two(num_groups: int, local: bool) -> None:
    from overworld.envs.gym_tasks import make_env

    env = make_env("CartPole-v1")
    spaces = spaces_from_gym(env.observation_space, env.action_space)
    pool = EnvPool("overworld.envs.gym_tasks:make_env", {"id": "CartPole-v1"}, spaces, 8, 2, num_groups, seed=0)
    try:
        processes_of_group = [set(pool._proc_of[slots].tolist()) for slots in pool.groups]
        assert pool.process_local_groups is local
        assert all(len(p) == 1 for p in processes_of_group) is local
        assert {len(p.groups) for p in pool.procs} == ({2} if local else {num_groups})
        tally = drive(pool, 20, until=lambda t: len(t["stepped"]) == 8 and min(t["stepped"].values()) > 50)
        assert sorted(tally["stepped"]) == list(range(8)) and not tally["failed"]
    finally:
        pool.close()


@pytest.mark.parametrize("backend", ["subprocess", "inprocess"])
def test_env_that_raises_is_rebuilt_alone(backend: str) -> None:
    kwargs = {"every": 7, "length": 20}
    if backend == "subprocess":
        pool = EnvPool(f"{ENVS}:crashing", kwargs, SPACES, 4, 2, 2, seed=0)
    else:
        pool = InProcessEnvPool(f"{ENVS}:crashing", kwargs, SPACES, 4, 2, seed=0)
    try:
        tally = drive(pool, 30, until=lambda t: t["failed"]["error"] >= 8 and len(t["stepped"]) == 4
                      and min(t["stepped"].values()) > 30)
        assert tally["failed"]["error"] >= 8 and set(tally["failed"]) == {"error"}
        assert min(tally["stepped"].values()) > 30  # every slot keeps stepping
        # Every reported failure was a restart; a failure counted by the pool may not be reported yet
        # (at most one per slot) when the loop stops.
        assert tally["failed"]["error"] <= pool.restarts["error"] <= tally["failed"]["error"] + 4
    finally:
        pool.close()


def test_hung_env_process_is_killed_and_restarted(tmp_path: Path) -> None:
    flag = faulty_envs.flag_path(tmp_path, "hang")
    pool = EnvPool(f"{ENVS}:hanging", {"flag": flag, "at": 15}, SPACES, 4, 2, 2, seed=0, step_timeout=1.0)
    try:
        tally = drive(pool, 40, until=lambda t: t["failed"]["timeout"] and pool.active.all()
                      and min(t["stepped"].values()) > 60)
        assert tally["failed"]["timeout"] == 2  # the hung env's process held two slots
        assert pool.restarts["timeout"] == 2 and pool.active.all()
        assert min(tally["stepped"].values()) > 60
    finally:
        pool.close()


def test_killed_env_process_is_restarted_while_others_go_on(tmp_path: Path) -> None:
    flag = faulty_envs.flag_path(tmp_path, "die")
    pool = EnvPool(f"{ENVS}:dying", {"flag": flag, "at": 15}, SPACES, 4, 2, 2, seed=0, step_timeout=10.0)
    try:
        tally = drive(pool, 40, until=lambda t: t["failed"]["died"] and pool.active.all()
                      and min(t["stepped"].values()) > 60)
        assert tally["failed"]["died"] == 2 and pool.restarts["died"] == 2
        assert tally["overlap"] > 0  # the other process stepped while the dead one came back
        assert pool.active.all()
    finally:
        pool.close()


def test_resets_happen_off_the_hot_path_and_restart_interval_recycles() -> None:
    # Resets take 0.3 s; episodes last 10 steps. A lockstep pool would step at most ~33 steps/s per
    # slot; here the other slots step while one resets.
    pool = EnvPool(f"{ENVS}:slow_reset", {"seconds": 0.3, "length": 10}, SPACES, 4, 2, 2, seed=0,
                   restart_interval=0.5)
    try:
        tally = drive(pool, 6)
        assert tally["ended"] >= 8 and tally["joined"] >= 8
        assert tally["overlap"] > 0
        assert pool.restarts["interval"] > 0 and not tally["failed"]
    finally:
        pool.close()


@pytest.mark.parametrize("backend", ["subprocess", "inprocess"])
def test_wake_ends_the_loops_wait_at_once(backend: str) -> None:
    """Room reserved by another thread wakes the worker's loop: a wait that would last a minute ends."""
    import threading

    pool = cartpole_pool(backend, 2, 1)
    try:
        drive(pool, 10, until=lambda t: pool.active.all())  # every env joined: nothing else will wake it
        for wait in (lambda: pool.idle_wait(60), lambda: pool.wait_any([0], 60) if backend == "subprocess" else None):
            threading.Timer(0.2, pool.wake).start()
            started = time.monotonic()
            wait()
            assert time.monotonic() - started < 30
        pool.wake()  # a wake that came before the wait ends it too
        started = time.monotonic()
        pool.idle_wait(60)
        assert time.monotonic() - started < 30
    finally:
        pool.close()
