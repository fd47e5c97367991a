"""Ray 2.60's token authentication, which the chart turns on (KubeRay's authOptions) and `overworld run`
uses for its local Ray: a real `ray start --head` with RAY_AUTH_MODE=token refuses the Jobs API (the
remote code execution door) and drivers without the token, and serves them with it."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support import free_port, wait_port

RAY = str(Path(sys.executable).parent / "ray")


def our_processes(marker: str) -> list[int]:
    """Processes whose command line names our private temp dir: what this test's Ray started."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def jobs_api(port: int, token: str | None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/jobs/")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def driver(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    code = f"import ray; ray.init(address={address!r}); print('CPUS', ray.cluster_resources().get('CPU'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.slow
def test_ray_token_authentication_refuses_callers_without_the_token() -> None:
    token = secrets.token_hex(32)
    temp = tempfile.mkdtemp(prefix="owray", dir="/tmp")  # short: Ray's socket paths are length-limited
    gcs, dashboard = free_port(), free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base.update(no_proxy="127.0.0.1,localhost", RAY_USAGE_STATS_ENABLED="0")
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        base.pop(var, None)
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--port", str(gcs), "--node-ip-address", "127.0.0.1",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--include-dashboard", "true",
         "--num-cpus", "1", "--temp-dir", temp, "--disable-usage-stats"],
        env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(dashboard, 180)
        deadline = time.monotonic() + 60
        while jobs_api(dashboard, token) != 200 and time.monotonic() < deadline:
            time.sleep(1)
        assert jobs_api(dashboard, token) == 200
        assert jobs_api(dashboard, None) == 401
        assert jobs_api(dashboard, "0" * 64) in (401, 403)
        address = f"127.0.0.1:{gcs}"
        refused = driver(address, {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
        assert refused.returncode != 0 and "CPUS" not in refused.stdout
        allowed = driver(address, {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
        assert allowed.returncode == 0 and "CPUS 1.0" in allowed.stdout, allowed.stderr[-2000:]
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        for pid in our_processes(temp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
