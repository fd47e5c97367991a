"""A real rollout worker (env subprocesses, shared memory) against real manager, buffer and
registry servers on loopback sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from overworld.core.wire.fragment import Fragment, validate
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_worker.worker import RolloutWorker
from tests.rollout_worker import faulty_envs
from tests.rollout_worker.conftest import Cluster, T

ENVS = str(Path(faulty_envs.__file__).resolve())  # a file path: see test_env_pool.py


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Running:
    def __init__(self, cluster: Cluster, backend: str | None = None) -> None:
        self.worker = RolloutWorker(*cluster.addresses, env_backend=backend)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop_event.set()
        self.thread.join(30)
        self.worker.shutdown()


def all_fragments(cluster: Cluster) -> list[Fragment]:
    stats = cluster.stats()
    chunks = cluster.take(stats.chunks)
    out = []
    for chunk in chunks:
        fragment = Fragment.from_proto(chunk.fragments[0])
        validate(fragment, cluster.spaces, cluster.config.rollout_config.fragment_length, "wtest")
        out.append(fragment)
    return out


@pytest.mark.parametrize("backend", ["subprocess", "inprocess"])
def test_worker_streams_valid_fragments_swaps_weights_and_flushes(make_cluster, backend: str) -> None:
    cluster = make_cluster()
    run = Running(cluster, backend)
    w = run.worker
    try:
        wait_for(lambda: w.sender.sent >= 8, 60, "8 fragments")
        cluster.publish(2)
        wait_for(lambda: w.model_version == 2, 30, "model version 2")
        swapped_at = w.fragments_completed  # two more rounds of the 4 slots (they step together): version-2 steps
        wait_for(lambda: w.fragments_completed >= swapped_at + 2 * 4, 60, "fragments after the swap")
    finally:
        run.stop()
    assert cluster.stats().inserted_fragments == w.sender.sent == w.fragments_completed  # nothing complete lost
    fragments = all_fragments(cluster)
    versions = set()
    for f in fragments:
        versions |= set(f.data["model_version"].tolist())
        assert f.worker_id == w.worker_id and 0 <= f.env_slot < 4
    assert versions >= {1, 2}
    # per slot, sequence numbers count up from 0 without gaps (no env failed)
    by_slot: dict[int, list[int]] = {}
    for f in fragments:
        by_slot.setdefault(f.env_slot, []).append(f.sequence)
    for seqs in by_slot.values():
        assert sorted(seqs) == list(range(len(seqs)))
    manager = cluster.manager
    assert manager._episodes > 0 and not manager._workers  # episodes reported; deregistered


@pytest.mark.parametrize("backend", ["subprocess", "inprocess"])
def test_every_group_of_slots_steps_its_share(make_cluster, backend: str) -> None:
    # Two groups of two slots: the in-process pool steps a group synchronously in send(), and a
    # wait_any that always answered the first group in flight left the second one stepped once.
    cluster = make_cluster(rollout_config={"worker_config": {"batch_size": 2}})
    run = Running(cluster, backend)
    w = run.worker
    try:
        assert len(w.pool.groups) == 2
        wait_for(lambda: w.sender.sent >= 24, 60, "24 fragments")
    finally:
        run.stop()
    per_slot = [0] * 4
    for f in all_fragments(cluster):
        per_slot[f.env_slot] += 1
    assert min(per_slot) >= max(per_slot) // 2 and min(per_slot) >= 3, per_slot


def test_a_finishing_worker_completes_the_fragments_under_way(make_cluster) -> None:
    # 50 ms a step: a fragment takes 0.8 s, so the call lands mid-fragment in every slot; two groups
    # take turns, so one finishes its fragments a step before the other
    cluster = make_cluster(env_generator=f"{ENVS}:paced", env_kwargs={"seconds": 0.05, "length": 40},
                           rollout_config={"worker_config": {"batch_size": 2}})
    run = Running(cluster, "inprocess")
    w = run.worker
    try:
        wait_for(lambda: w.sender.sent >= 4 and w.cutter.t.all(), 60, "4 fragments, then every slot mid-fragment")
        started = w.fragments_completed
        w.finish(10.0)
        run.thread.join(10.0)
        assert not run.thread.is_alive() and not w.cutter.t.any()
        assert w.fragments_completed >= started + 4  # one more per slot: none begun after the call
        assert w.fragments_completed <= started + 4
        assert not w._with_room(np.arange(w.N)).size  # every slot at a boundary, and none may begin
    finally:
        run.stop()
    assert w.preempted_env_steps == 0
    assert cluster.stats().inserted_fragments == w.sender.sent == w.fragments_completed


def test_finishing_gives_up_at_its_deadline(make_cluster) -> None:
    cluster = make_cluster(env_generator=f"{ENVS}:paced", env_kwargs={"seconds": 0.2, "length": 40})
    run = Running(cluster, "inprocess")
    w = run.worker
    try:
        wait_for(lambda: w.env_steps >= 8, 60, "8 env steps")  # a fragment takes 3.2 s: mid-fragment
        called = time.monotonic()
        w.finish(0.5)
        run.thread.join(5.0)
        assert not run.thread.is_alive() and time.monotonic() - called < 1.5
    finally:
        run.stop()
    assert w.preempted_env_steps > 0  # what could not be finished in time is counted, not sent


@pytest.mark.parametrize("fault", ["crash", "hang", "die"])
def test_faulty_envs_still_yield_valid_fragments(make_cluster, tmp_path: Path, fault: str) -> None:
    gen, kwargs, reason = {
        "crash": ("crashing", {"every": 23, "length": 40}, "error"),
        "hang": ("hanging", {"flag": str(tmp_path / "hang.flag"), "at": 20, "length": 40}, "timeout"),
        "die": ("dying", {"flag": str(tmp_path / "die.flag"), "at": 20, "length": 40}, "died"),
    }[fault]
    cluster = make_cluster(env_generator=f"{ENVS}:{gen}", env_kwargs=kwargs,
                           rollout_config={"worker_config": {"step_timeout": 1.0}})
    run = Running(cluster)
    w = run.worker
    try:
        wait_for(lambda: w.pool.restarts[reason] > 0, 60, f"an env restart ({reason})")
        sent = w.sender.sent
        wait_for(lambda: w.sender.sent >= sent + 12, 60, "fragments after the restart")
    finally:
        run.stop()
    assert w.fragments_dropped > 0  # the partial fragments of the restarted envs
    assert cluster.stats().inserted_fragments == w.sender.sent == w.fragments_completed
    fragments = all_fragments(cluster)
    assert len(fragments) >= 12
    for f in fragments:
        # The counting env's observation is its step count: consecutive within an episode.
        steps = f.data["obs.obs"][:, 0]
        for t in range(1, T):
            if not f.data["first"][t]:
                assert steps[t] == steps[t - 1] + 1, (f.env_slot, f.sequence, steps)
            else:
                assert steps[t] == 0


def test_episode_statistics_and_video_arrive(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(env_generator=f"{ENVS}:counting", env_kwargs={"length": 30, "image": True},
                           task_name="count", rollout_config={"worker_config": {"video_fps": 10}})
    client = RolloutManagerClient(cluster.ms.address)
    run = Running(cluster)
    try:
        wait_for(lambda: cluster.manager._episodes >= 4, 60, "episode statistics")
        request_id = client.request_video(3)
        wait_for(lambda: len(client.list_videos()) == 1, 60, "a video")
    finally:
        run.stop()
    (task,) = client.fleet_status().tasks
    assert task.task == "count" and task.mean_return_last_100 == 30.0 and task.mean_length_last_100 == 30
    assert task.mean_extras_last_100["achievement_count"] == 30.0
    assert task.mean_discounted_return_last_100 == pytest.approx(sum(0.999**i for i in range(30)), rel=1e-6)
    (video,) = client.list_videos()
    assert video.request_id == request_id and video.iteration == 3 and video.length == 30 and video.fps == 10
    assert video.worker_id == run.worker.worker_id and video.task == "count"
    data = cluster.manager.videos.store.get(video.key)
    assert len(data) == video.size_bytes and data[4:8] == b"ftyp"
    path = tmp_path / "v.mp4"
    path.write_bytes(data)
    import imageio.v2 as imageio

    with imageio.get_reader(path, format="FFMPEG") as reader:
        frames = [frame for frame in reader]  # noqa: C416 - list() asks len(), which is inf
    assert len(frames) == 31 and frames[0].shape == (16, 16, 3)  # every step's observation + the final one
