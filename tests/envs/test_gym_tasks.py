"""The gymnasium classics at a game's pace: the same steps, each taking at least `step_seconds`."""

from __future__ import annotations

import time

import numpy as np
import pytest

from overworld.envs.gym_tasks import make_env


def test_a_paced_env_steps_as_the_plain_one_only_slower() -> None:
    plain, paced = make_env(), make_env(step_seconds=0.02)
    a, _ = plain.reset(seed=3)
    b, _ = paced.reset(seed=3)
    assert np.array_equal(a, b)
    started = time.monotonic()
    for step in range(10):
        action = step % 2
        assert all(np.array_equal(x, y) for x, y in zip(plain.step(action), paced.step(action), strict=True))
    assert time.monotonic() - started >= 10 * 0.02 * 0.95
    assert make_env(step_seconds=0).__class__ is plain.__class__  # no wrapper when not paced


def test_a_negative_pace_is_refused() -> None:
    with pytest.raises(ValueError, match="step_seconds"):
        make_env(step_seconds=-1)
