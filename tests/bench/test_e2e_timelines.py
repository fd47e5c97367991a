"""bench/bench_e2e.py reads a run's startup and iteration timelines from what `overworld run` writes as
data (the summary's milestones, the learning curve's timings and push latencies), never from the
wording of a service's log: a run directory laid out as `overworld run` leaves it is read here without
running anything."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench_e2e import iteration_timeline, startup_timeline
from bench.runs import read_run
from overworld.launch.milestones import STARTUP_MILESTONES, StartupMilestones

SPAWNED = 1_700_000_000.0


def run_directory(tmp_path: Path) -> Path:
    """summary.json and progress.jsonl as `overworld run` writes them (logs that would mislead a log
    parser, to show they are not read)."""
    milestones = StartupMilestones(SPAWNED)
    for i, name in enumerate(STARTUP_MILESTONES):
        if name != "training_started":  # not reached (the run stopped first): null in the timeline
            milestones.note(name, SPAWNED + 1.0 + i)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "max_env_steps", "milestones": milestones.reached}))
    timings = {"sample": 0.01, "values": 0.02, "gae": 0.03, "update": 0.1, "publish": 0.05, "post_iteration": 0.02,
               "iteration": 0.2}
    curve = [{"wall_seconds": 2.0 * i, "env_steps": 256 * i, "updates": i,
              **{f"trainer/{part}_seconds": seconds * (1 + i % 2) for part, seconds in timings.items()},
              **({"registry/push_seconds": 0.01 * i} if i else {})} for i in range(5)]
    (tmp_path / "progress.jsonl").write_text("".join(json.dumps(p) + "\n" for p in curve))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer.log").write_text("2023-11-14 22:13:20,000 trainer INFO first update done: 1\n")
    return tmp_path


def test_the_startup_timeline_is_the_summarys_milestones_from_the_command_start(tmp_path: Path) -> None:
    summary = read_run(run_directory(tmp_path))
    startup = startup_timeline(summary, SPAWNED)
    assert list(startup) == list(STARTUP_MILESTONES)
    assert startup["gae_started"] == 1.0 + STARTUP_MILESTONES.index("gae_started")
    assert startup["first_update"] == 1.0 + STARTUP_MILESTONES.index("first_update")
    assert startup["training_started"] is None
    assert startup_timeline({"status": "no summary"}, SPAWNED) == dict.fromkeys(STARTUP_MILESTONES)


def test_the_iteration_timeline_is_the_medians_of_the_curves_timings_and_push_latencies(tmp_path: Path) -> None:
    summary = read_run(run_directory(tmp_path))
    timeline = iteration_timeline(summary)
    assert timeline["iteration"] == 0.2 and timeline["update"] == 0.1  # median of 0.2, 0.4, 0.2, 0.4, 0.2
    assert timeline["publish_to_swapped_in_at_workers"] == 0.025  # median of 0.01 ... 0.04
    assert timeline["iterations_sampled"] == 5
