"""detach_rollout_manager: false ties the rollout side to the script that started it (MineStudio's
non-detached actor dies with its driver); start_trainer without a rollout side says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from overworld.online import start_trainer
from overworld.online.rollout_side import STATE_FILE, alive, read_state

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
from overworld.online import start_rolloutmanager

online_dict = {
    "detach_rollout_manager": False,
    "env_kwargs": {"id": "CartPole-v1"},
    "rollout_config": {"num_rollout_workers": 1, "fragment_length": 16,
                       "worker_config": {"num_envs": 2, "batch_size": 2, "env_backend": "inprocess"}},
    "train_config": {"batches_per_iteration": 1, "gradient_accumulation": 1, "context_length": 16},
}

if __name__ == "__main__":
    print(start_rolloutmanager("overworld.policies.nets:make_mlp_policy", "overworld.envs.gym_tasks:make_env",
                               online_dict))
"""


@pytest.mark.slow
def test_a_non_detached_rollout_side_stops_with_its_script(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT))
    work = tmp_path / "work"
    env = {**os.environ, "OVERWORLD_WORKDIR": str(work), "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT)])}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'rollout-manager': '127.0.0.1:" in out.stdout
    deadline = time.monotonic() + 120
    while (work / STATE_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not (work / STATE_FILE).exists() and not alive(read_state(work))


def test_start_trainer_without_a_rollout_side_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"no rollout side is running in .*: call start_rolloutmanager"):
        start_trainer("overworld.policies.nets:make_mlp_policy", "overworld.envs.gym_tasks:make_env", {},
                      workdir=tmp_path)
