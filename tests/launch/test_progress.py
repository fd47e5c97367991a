"""`overworld run`'s progress line: the totals against the run's budget (env steps, iterations, target
return), the percent done and the time left at the current pace; the policy lag is how many versions the
workers run behind the learner, never negative (the workers read a new version from the registry before
the trainer's status says it published it). On a terminal one line rewritten in place, cut to its
width; to a file or a pipe, plain lines, less often."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from overworld.launch.progress import (
    CLEAR_TO_END_OF_LINE,
    PLAIN_INTERVAL_SECONDS,
    TTY_INTERVAL_SECONDS,
    Budget,
    ProgressDisplay,
    Rate,
    Snapshot,
    format_duration,
    format_progress,
    time_left,
)


def snapshot(trainer_version: int = 5, worker_versions: tuple[int, ...] = (3, 4), env_steps: int = 5_000,
             iteration: int = 20, offset: int = 0) -> Snapshot:
    fleet = SimpleNamespace(env_steps=env_steps, episodes=10, mean_return_last_100=21.5,
                            workers=[SimpleNamespace(model_version=v) for v in worker_versions])
    trainer = SimpleNamespace(model_version=trainer_version, updates=7, iteration=iteration)
    return Snapshot.of(fleet, trainer, wall_seconds=10.0, offset=offset)


def test_lag_counts_the_versions_the_workers_run_behind() -> None:
    s = snapshot(5, (3, 4))
    assert s.lag == 1.5 and s.workers == 2
    text = format_progress(s, Budget(max_env_steps=10_000))
    assert "lag 1.5" in text and "workers 2" in text, text


def test_the_line_shows_the_share_of_env_steps_the_learner_trained_on() -> None:
    """A fleet that steps more than the learner samples has most of its data dropped as stale: the line says
    how much was used (a 12-worker CartPole fleet trained on 7% of its steps while the line showed lag 1)."""
    fleet = SimpleNamespace(env_steps=40_000, episodes=10, mean_return_last_100=21.5,
                            workers=[SimpleNamespace(model_version=5)])
    trainer = SimpleNamespace(model_version=5, updates=7, iteration=20, samples_trained=3_000)
    s = Snapshot.of(fleet, trainer, wall_seconds=10.0)
    assert "used 8%" in format_progress(s, Budget()), format_progress(s, Budget())
    fleet.env_steps = 0
    assert "used" not in format_progress(Snapshot.of(fleet, trainer, wall_seconds=1.0), Budget())


def test_workers_ahead_of_the_trainers_last_status_show_no_lag() -> None:
    assert snapshot(4, (5, 5)).lag == 0.0
    assert "lag 0.0" in format_progress(snapshot(4, (5, 5)), Budget()), format_progress(snapshot(4, (5, 5)), Budget())


def test_the_line_shows_each_budget_with_its_total_and_percent_and_the_time_left() -> None:
    s = snapshot(env_steps=5_000, iteration=20)
    text = format_progress(s, Budget(max_env_steps=20_000, iterations=1_000, target_return=450.0),
                           steps_per_second=100.0, iterations_per_second=1.0)
    assert "env steps 5,000/20,000 (25%) 100/s" in text, text
    assert "iteration 20/1,000 (2%)" in text, text
    assert "return(100) 21.50/450" in text, text
    assert "left 2:30" in text, text  # env steps: 15,000 at 100/s = 150 s, before 980 iterations at 1/s
    assert text.startswith("[   0:10]"), text


def test_a_resumed_run_counts_from_the_checkpoints_env_steps() -> None:
    s = snapshot(env_steps=5_000, offset=100_000)
    assert s.env_steps == 105_000
    assert "env steps 105,000/200,000 (52%)" in format_progress(s, Budget(max_env_steps=200_000))


def test_without_a_total_or_a_pace_nothing_is_made_up() -> None:
    text = format_progress(snapshot(), Budget())
    assert "env steps 5,000 " in text and "iteration 20 " in text and "left --:--" in text, text
    assert "%" not in text and "/s" not in text, text
    # a target return alone has no pace to extrapolate
    assert time_left(snapshot(), Budget(target_return=450.0), 100.0, 1.0) is None


def test_the_time_left_is_the_first_budget_reached() -> None:
    s = snapshot(env_steps=5_000, iteration=20)
    assert time_left(s, Budget(max_env_steps=10_000, iterations=1_000), 1_000.0, 10.0) == pytest.approx(5.0)
    assert time_left(s, Budget(max_env_steps=10_000, iterations=30), 1.0, 10.0) == pytest.approx(1.0)
    assert time_left(s, Budget(max_env_steps=10_000), None, 10.0) is None


def test_durations() -> None:
    assert [format_duration(x) for x in (None, 0, 59.6, 150, 3_600, 5_025)] == [
        "--:--", "0:00", "1:00", "2:30", "1:00:00", "1:23:45"]


def test_the_pace_is_the_recent_one() -> None:
    rate = Rate(window=10.0)
    assert rate.per_second() is None
    for t, count in ((0, 0), (5, 0), (10, 0), (20, 2_000), (25, 3_000)):  # idle for 10 s, then 200/s
        rate.add(t, count)
    assert rate.per_second() == pytest.approx(200.0)


def test_on_a_terminal_one_line_is_rewritten_in_place_and_cut_to_its_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "30")
    out = io.StringIO()
    display = ProgressDisplay(out, tty=True)
    assert display.due(0.0)
    display.show("a" * 100, 0.0)
    assert not display.due(TTY_INTERVAL_SECONDS / 2) and display.due(TTY_INTERVAL_SECONDS)
    display.show("b" * 10, 1.0)
    assert out.getvalue() == f"\r{'a' * 29}{CLEAR_TO_END_OF_LINE}\r{'b' * 10}{CLEAR_TO_END_OF_LINE}"
    display.message("trainer exited with code 1; restarting it")  # on a line of its own
    display.show("c", 2.0)
    display.close()
    assert out.getvalue().endswith(f"{'b' * 10}{CLEAR_TO_END_OF_LINE}\ntrainer exited with code 1; restarting it\n"
                                   f"\rc{CLEAR_TO_END_OF_LINE}\n")


def test_to_a_file_plain_lines_less_often() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out, tty=False)
    display.show("one", 0.0)
    assert not display.due(TTY_INTERVAL_SECONDS) and display.due(PLAIN_INTERVAL_SECONDS)
    display.show("two", PLAIN_INTERVAL_SECONDS)
    display.message("stopping services...")
    display.close()
    assert out.getvalue() == "one\ntwo\nstopping services...\n"
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
