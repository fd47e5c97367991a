"""No credential leaks: a real `overworld run` (mutual TLS, Redis with a password, Ray with a token)
trains, and neither its logs, its files outside tls/, its output nor `overworld status` contain the
Redis password, a private key or the Ray token."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import RedisServer
from tests.support import stop_process

ROOT = Path(__file__).resolve().parents[2]


def secret_values(tls_root: Path) -> dict[str, str]:
    """What must not leak from a run: every private key's body and the Ray token."""
    found = {}
    for key in tls_root.glob("*/tls.key"):
        body = "".join(line for line in key.read_text().splitlines() if "-----" not in line)
        found[f"private key of {key.parent.name}"] = body[16:48]  # any distinctive piece of it
    found["ray token"] = (tls_root / "ray-auth-token").read_text().strip()
    return found


def leaks(text: str, values: dict[str, str]) -> list[str]:
    return [name for name, value in values.items() if value and value in text]


def overworld_status(manager: str, flags: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "overworld.cli", "status", "--rollout-manager", manager, *flags],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.slow
def test_a_secure_run_trains_and_leaks_no_secret(tmp_path: Path) -> None:
    password = secrets.token_urlsafe(24)
    redis = RedisServer(tmp_path / "redis", password=password)
    redis.start()
    work = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OVERWORLD_REDIS_PASSWORD": password}
    env.pop("OVERWORLD_TLS_DIR", None)
    run = subprocess.Popen(
        [sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples/cartpole.yaml"), "--max-env-steps", "2500",
         "--workdir", str(work), "--summary", str(tmp_path / "summary.json"),
         "--set", f"rollout_config.replay_buffer_config.database_config.index=redis://127.0.0.1:{redis.port}/0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(run.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    statuses = []
    try:
        deadline = time.monotonic() + 400
        manager = None
        while run.poll() is None and time.monotonic() < deadline:
            found = [re.match(r"\s+rollout-manager\s+(\S+)\s+pid", line) for line in list(output)]
            manager = next((m.group(1) for m in found if m), manager)
            if manager and not statuses:
                secure = overworld_status(manager, ["--tls-dir", str(work / "tls" / "operator")], env)
                if secure.returncode == 0:  # the manager is up: the same without a certificate
                    statuses += [secure, overworld_status(manager, ["--insecure"], env)]
            time.sleep(1)
        run.wait(300)
    finally:
        if run.poll() is None:
            stop_process(run, 200)
        reader.join(10)
        redis.stop()
    text = "".join(output)
    summary = (tmp_path / "summary.json").read_text()
    assert '"status": "max_env_steps"' in summary, text[-4000:]
    assert statuses, "overworld status never answered during the run"
    secure, plaintext = statuses
    assert secure.returncode == 0 and "run " in secure.stdout, secure.stdout + secure.stderr
    assert plaintext.returncode == 1 and "unreachable" in plaintext.stderr  # the run refuses plaintext
    values = {"redis password": password, **secret_values(work / "tls")}
    assert leaks(text, values) == []
    for answer in statuses:
        assert leaks(answer.stdout + answer.stderr, values) == []
    files = [p for p in work.rglob("*") if p.is_file() and (work / "tls") not in p.parents]
    assert any(p.name == "replay-buffer.log" for p in files)
    for path in files:
        assert leaks(path.read_text(errors="replace"), values) == [], path
