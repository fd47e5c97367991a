"""overworld.online's parts that need no services: generators by import path, MineStudio's metric
names and per-iteration episode statistics, task labels from obs["task"], the pipeline report."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import gymnasium
import numpy as np
import pytest

from overworld.core.config import load_config
from overworld.envs.minestudio import adapt_env
from overworld.online import GeneratorError, generator_ref
from overworld.online.rollout_side import alive, process_start_time, rollout_key
from overworld.rollout_worker.env_runner import TASK_KEY, episode_extras
from overworld.rollout_worker.pipeline_report import PipelineReport
from overworld.trainer.minestudio_metrics import MineStudioMetrics
from overworld.v1 import rollout_manager_pb2 as mpb
from tests.minestudio import minecraft_sim_standin


def module_level_generator() -> None:
    return None


def test_generators_travel_by_import_path_and_closures_are_refused(tmp_path: Path) -> None:
    assert generator_ref(module_level_generator, "env_generator") == \
        "tests.online.test_online_units:module_level_generator"
    with pytest.raises(GeneratorError, match=r"env_generator \(.*<lambda>\) is a lambda: .*def env_generator\(\):"):
        generator_ref(lambda: None, "env_generator")

    def closure() -> None:
        return None

    with pytest.raises(GeneratorError, match="defined inside another function"):
        generator_ref(closure, "policy_generator")
    # A function of the script being run (`__main__`) is found by its file.
    script = tmp_path / "quick.py"
    script.write_text(textwrap.dedent("""
        from overworld.online import generator_ref
        def env_generator():
            return None
        print(generator_ref(env_generator, "env_generator"))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == f"{script.resolve()}:env_generator"


def test_a_rollout_side_that_exited_is_not_alive_while_it_waits_to_be_reaped() -> None:
    """The script that started a non-detached rollout side is its parent: once it exits it is a zombie
    until reaped, and the script's exit must not wait for it to "stop" (it waited out its 200 s timeout)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    record = {"pid": child.pid, "pid_started": process_start_time(child.pid)}
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        for _ in range(200):
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        assert stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert not alive(record)
    finally:
        child.wait(10)


def test_rollout_side_is_reused_unless_what_it_is_built_from_changes() -> None:
    base = load_config({"train_config": {"learning_rate": 1e-4}})
    assert rollout_key(base) == rollout_key(load_config({"train_config": {"learning_rate": 5e-4}}))
    assert rollout_key(base) != rollout_key(load_config({"train_config": {"discount": 0.9}}))
    assert rollout_key(base) != rollout_key(load_config({"rollout_config": {"fragment_length": 128}}))


def _fleet(*tasks: tuple[str, int, float, float, int], env_steps: int = 0) -> mpb.FleetStatus:
    return mpb.FleetStatus(env_steps=env_steps, tasks=[
        mpb.TaskStats(task=t, episodes=n, total_return=r, total_discounted_return=d, total_length=length)
        for t, n, r, d, length in tasks])


def test_episode_statistics_under_minestudios_names_per_iteration() -> None:
    config = load_config({"env_generator": "tests.minestudio.minecraft_sim_standin:env_generator"})
    metrics = MineStudioMetrics()
    first = metrics.episode_statistics(_fleet(("env_generator", 2, 3.0, 2.5, 50), ("chop", 1, 1.0, 1.0, 10)),
                                       config, step=100)
    assert first["episode_statistics/4train/sum_reward"] == 1.5  # no task: MineStudio's "" + "4train"
    assert first["episode_statistics/4train/discounted_reward"] == 1.25
    assert first["episode_statistics/4train/episode_length"] == 25
    assert first["episode_statistics/chop4train/episode_count"] == 1
    assert first["episode_statistics/chop4train/frequency"] == pytest.approx(1 / 3)
    assert first["episode_statistics/episode_count"] == 3 and first["episode_statistics/step"] == 100
    assert first["episode_statistics/mean_sum_reward"] == pytest.approx((1.5 + 1.0) / 2)
    # the next iteration sees only the episodes that ended since (MineStudio resets its metrics)
    second = metrics.episode_statistics(_fleet(("env_generator", 3, 7.0, 5.0, 80), ("chop", 1, 1.0, 1.0, 10)),
                                        config, step=200)
    assert second["episode_statistics/4train/sum_reward"] == 4.0
    assert "episode_statistics/chop4train/sum_reward" not in second
    assert metrics.episode_statistics(_fleet(("env_generator", 3, 7.0, 5.0, 80)), config, step=300) == {}


def test_replay_buffer_and_sps_metrics_from_the_services() -> None:
    class Manager:
        def __init__(self) -> None:
            self.steps = 0

        def fleet_status(self, timeout: float) -> mpb.FleetStatus:
            self.steps += 1000
            return _fleet(env_steps=self.steps)

    stats = SimpleNamespace(inserted_fragments=10, chunks=4, model_version=3, mean_reuse=0.5, mean_staleness=1.0)
    buffer = SimpleNamespace(stats=lambda timeout: stats)  # ReplayBufferClient.stats
    trainer = SimpleNamespace(rank=0, manager=Manager(), buffer=buffer, env_steps=0,
                              config=load_config({}))
    hook = MineStudioMetrics()
    out: dict[str, float] = {}
    hook(trainer, out)
    stats.inserted_fragments = 30
    hook(trainer, out)
    assert out["replay_buffer/fragments_per_second"] > 0 and out["trainer/env_SPS_all_workers"] > 0
    assert out["replay_buffer/replay_buffer_size (chunk)"] == 4 and out["replay_buffer/model_version"] == 3
    assert out["replay_buffer/avg_reuse"] == 0.5 and out["replay_buffer/avg_staleness"] == 1.0


class TaskSim(minecraft_sim_standin.StandInSim):
    """MinecraftSim with TaskCallback: obs["task"] = {"name", "text"}; plus an undeclared non-array key."""

    def _obs(self):  # type: ignore[no-untyped-def]
        return {**super()._obs(), "task": {"name": "chop", "text": "chop a tree"}, "voxels": {"a": 1}}


def test_task_labels_come_from_obs_task_and_dropped_keys_are_named(caplog: pytest.LogCaptureFixture) -> None:
    env = adapt_env(TaskSim(time_limit=2))
    with caplog.at_level("WARNING", "overworld.envs.minestudio"):
        obs, _ = env.reset()
        assert set(obs) == {"image"}
        _, _, _, _, info = env.step({"buttons": np.int64(0), "camera": np.int64(0)})
        _, _, terminated, _, info = env.step({"buttons": np.int64(0), "camera": np.int64(0)})
    assert terminated and episode_extras(info)[TASK_KEY] == "chop"
    assert any("voxels" in r.getMessage() for r in caplog.records)
    assert not any("'task'" in r.getMessage() or " task" in r.getMessage().split(":")[0] for r in caplog.records)
    assert TASK_KEY not in episode_extras({"task": 3})  # only a string labels an episode
    assert isinstance(env.observation_space, gymnasium.spaces.Dict)


def test_pipeline_report_every_log_interval_seconds() -> None:
    report = PipelineReport(log_interval=10.0, duration=300.0, max_fast_reset=7)
    report.update("env_step", 0.004)
    report.update("inference", 0.002)
    report.update("queue_size_after_inference", 3)
    assert report.maybe_log(now=report.last + 1) is None
    line = report.maybe_log(now=report.last + 11)
    assert line is not None and "env_step 4.00 ms" in line and "inference 2.00 ms" in line
    assert "queue size after inference 3.00" in line and "max_fast_reset 7" in line
    assert PipelineReport(None, 300.0, 1).maybe_log(now=1e9) is None  # log_interval null: MineStudio's default


def test_a_video_trigger_records_the_configured_episodes_with_vpred_drawn(tmp_path: Path) -> None:
    from overworld.core.blobs.urls import open_blob_store
    from overworld.rollout_manager.videos import VideoBook
    from overworld.rollout_worker.video import draw_vpred

    book = VideoBook(open_blob_store(str(tmp_path)), str(tmp_path), "r", interval=2, episodes=4)
    book.request(iteration=2)
    assert book.pending() == 4 and {book.assign(w) for w in ("a", "b", "c", "d")} != {""}
    frame = np.zeros((64, 64, 3), np.uint8)
    drawn = draw_vpred(frame, 1.234)
    assert drawn.shape == frame.shape and drawn.dtype == np.uint8 and drawn[:16].any() and not drawn[40:].any()


def test_fragments_per_report_logs_minestudios_replay_buffer_report(caplog: pytest.LogCaptureFixture) -> None:
    from overworld.replay_buffer.server import InsertReport

    stats = SimpleNamespace(chunks=5, model_version=2)
    report = InsertReport(3, SimpleNamespace(stats=lambda: stats))  # type: ignore[arg-type]
    lines = [report.inserted() for _ in range(6)]
    assert lines[:2] == [None, None] and lines[3:5] == [None, None]
    assert lines[2] is not None and "replay_buffer_size (chunk) 5, model_version 2" in lines[2]
    assert InsertReport(0, SimpleNamespace()).inserted() is None  # type: ignore[arg-type]
