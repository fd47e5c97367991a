"""`overworld run`'s progress line: the policy lag is how many versions the workers run behind the
learner, never negative (the workers read a new version from the registry before the trainer's status
says it published it)."""

from __future__ import annotations

from types import SimpleNamespace

from overworld.launcher import progress_line


def line(trainer_version: int, worker_versions: list[int]) -> str:
    fleet = SimpleNamespace(env_steps=5_000, episodes=10, mean_return_last_100=21.5,
                            workers=[SimpleNamespace(model_version=v) for v in worker_versions])
    trainer = SimpleNamespace(model_version=trainer_version, updates=7)
    return progress_line(fleet, trainer, elapsed=10.0, max_env_steps=10_000)


def test_lag_counts_the_versions_the_workers_run_behind() -> None:
    text = line(5, [3, 4])
    assert "lag  1.5" in text and "env steps      5,000/10,000" in text and "workers 2" in text, text


def test_workers_ahead_of_the_trainers_last_status_show_no_lag() -> None:
    assert "lag  0.0" in line(4, [5, 5]), line(4, [5, 5])
