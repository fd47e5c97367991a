"""What `overworld run` records as data: the learning curve carries the figures a task declares
(envs/task_metrics.py: Crafter's tasks their extras and Crafter's score), none for a task that declares
none, and `<workdir>/status.json` holds the run's state, budget, progress and startup milestones."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from overworld.core.imports import import_object
from overworld.envs.task_metrics import NO_TASK_METRICS, declared_task_metrics
from overworld.launch.curve import curve_point, task_figures
from overworld.launch.status import format_run_status, read_run_status, write_run_status


def fleet(extras: dict[str, float], totals: dict[str, float]) -> SimpleNamespace:
    task = SimpleNamespace(task="cow", episodes=4, mean_return_last_100=3.0, mean_length_last_100=100.0,
                           mean_extras_last_100=extras, total_extras=totals)
    return SimpleNamespace(episodes=4, mean_return_last_100=3.0, tasks=[task])


TRAINER = SimpleNamespace(model_version=3, updates=12, iteration=2,
                          metrics={"trainer/iteration_seconds": 0.123456, "trainer/policy_loss": 0.5})


def test_a_crafter_task_declares_its_curve_extras_and_crafters_score() -> None:
    metrics = declared_task_metrics(import_object("overworld.envs.crafter_cow:make_env"))
    assert metrics.curve_extras == ("cows_eaten", "achievement_eat_cow")
    f = fleet({"cows_eaten": 2.5, "achievement_eat_cow": 1.0, "achievement_wake_up": 0.5},
              {"achievement_eat_cow": 4.0, "achievement_wake_up": 2.0})
    point = curve_point(12.345, 1_000, f, TRAINER, metrics, push_seconds=0.0123)
    assert point["cow/cows_eaten"] == 2.5 and point["cow/achievement_eat_cow"] == 1.0
    assert "cow/achievement_wake_up" not in point  # not declared for the curve
    assert 0 < point["cow/crafter_score"] < 100
    assert point["trainer/iteration_seconds"] == 0.1235 and "trainer/policy_loss" not in point
    assert point["registry/push_seconds"] == 0.0123 and point["wall_seconds"] == 12.35
    summary = task_figures(f, metrics)["cow"]
    assert summary["crafter"]["episodes"] == 4 and summary["achievement_wake_up"] == 0.5


def test_a_task_that_declares_nothing_reports_the_generic_figures_only() -> None:
    metrics = declared_task_metrics(import_object("overworld.envs.gym_tasks:make_env"))
    assert metrics is NO_TASK_METRICS
    f = fleet({"cows_eaten": 2.5, "achievement_eat_cow": 1.0}, {"achievement_eat_cow": 4.0})
    point = curve_point(1.0, 10, f, TRAINER, metrics)
    assert not [k for k in point if k.startswith("cow/")] and "registry/push_seconds" not in point
    assert "crafter" not in task_figures(f, metrics)["cow"]


def test_the_status_file_says_where_the_run_stands(tmp_path: Path) -> None:
    write_run_status(tmp_path, {"run_id": "r", "state": "running",
                                "budget": {"max_env_steps": 20_000, "iterations": 1_000, "target_return": 450.0},
                                "progress": {"env_steps": 5_000, "iteration": 20, "mean_return_last_100": 21.5,
                                             "seconds_left": 150.0},
                                "milestones": {"first_update": 1_700_000_011.37}})
    status = read_run_status(tmp_path)
    assert status["milestones"]["first_update"] == 1_700_000_011.37 and status["updated_unix"] > 0
    assert json.loads((tmp_path / "status.json").read_text()) == status
    assert format_run_status(status) == ("run r: running, 5,000/20,000 env steps, iteration 20/1,000, "
                                         "return(100) 21.50/450, about 150s left")
