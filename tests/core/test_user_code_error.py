"""An error of the user's generator is a UserCodeError (the service exits 78 and is not restarted); one
of the machine (OSError, MemoryError) is not, a restart may heal it. The service logs the user's
traceback once, from the generator's frame down, its message only on the traceback's last line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overworld.core.imports import UserCodeError, call_generator
from overworld.core.service import REFUSAL_RECORD, log_refusal
from tests.support import free_port


def buggy_policy(hidden_sizes: list[int] | None = None) -> None:
    width = "64"
    return width + 64  # type: ignore[return-value, operator]


def missing_weights() -> None:
    raise FileNotFoundError("weights.pt")


def test_an_error_of_the_generators_code_is_the_users() -> None:
    with pytest.raises(UserCodeError) as caught:
        call_generator(buggy_policy, {"hidden_sizes": [64]}, observation_space=None)
    assert isinstance(caught.value.__cause__, TypeError)
    assert caught.value.generator.endswith(":buggy_policy")
    assert str(caught.value).endswith('raised TypeError: can only concatenate str (not "int") to str')


def test_kwargs_the_generator_does_not_take_are_the_users_mistake() -> None:
    with pytest.raises(UserCodeError, match="does not accept hidden_layers"):
        call_generator(buggy_policy, {"hidden_layers": [64]})


def simulator_that_did_not_start() -> None:
    raise RuntimeError("CUDA error: out of memory")  # torch's OOM and CUDA init errors, a game that failed to launch


def test_an_error_of_the_machine_is_not() -> None:
    with pytest.raises(FileNotFoundError):
        call_generator(missing_weights, {})
    with pytest.raises(RuntimeError):
        call_generator(simulator_that_did_not_start, {})


def test_the_refusal_is_one_record_with_the_users_traceback(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(UserCodeError) as caught:
        call_generator(buggy_policy, {})
    with caplog.at_level(logging.ERROR):
        log_refusal(logging.getLogger("overworld.test"), caught.value)
    assert len(caplog.records) == 1
    text = caplog.text
    assert REFUSAL_RECORD in text and "exit code 78" in text
    assert text.count("can only concatenate str") == 1 and text.count("Traceback (most recent call last)") == 1
    assert "in buggy_policy" in text and "call_generator" not in text  # the user's frames, not Overworld's


def test_a_service_whose_config_is_wrong_exits_78_with_one_record(tmp_path: Path) -> None:
    """A run config it cannot use (here a misspelt key) is the user's mistake too: a restart would read
    the same file. The rollout-manager says which key, once, and exits 78 (not a traceback and 1)."""
    config = tmp_path / "config.yaml"
    config.write_text("train_config:\n  learning_rat: 0.001\n")
    result = subprocess.run(
        [sys.executable, "-m", "overworld.cli", "serve", "rollout-manager", "--host", "127.0.0.1", "--port",
         str(free_port()), "--metrics-port", "0", "--config", str(config), "--workdir", str(tmp_path / "m")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OVERWORLD_LOG_FORMAT": "text"})
    assert result.returncode == 78, result.stderr[-3000:]
    assert result.stderr.count(REFUSAL_RECORD) == 1 and "learning_rat" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
