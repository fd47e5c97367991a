"""`overworld serve rollout-worker` as its own process: SIGTERM mid-run flushes every complete
fragment to the replay buffer, deregisters, and leaves no env process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_worker.client import RolloutWorkerClient
from tests.rollout_worker.conftest import T
from tests.rollout_worker.test_worker import wait_for
from tests.support import alive, free_port, wait_port

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> set[int]:
    out = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.add(int(proc.name))
    return out


def test_sigterm_flushes_complete_fragments_and_deregisters(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(rollout_config={"to_send_queue_size": 2,
                                           "worker_config": {"num_envs": 6, "num_env_processes": 2}})
    manager_addr, buffer_addr, registry_addr = cluster.addresses
    port = free_port()
    env = {**os.environ, "OVERWORLD_LOG_FORMAT": "text", "PYTHONPATH": str(ROOT / "services")}
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "overworld.cli", "serve", "rollout-worker", "--host", "127.0.0.1", "--port",
             str(port), "--metrics-port", "0", "--rollout-manager", manager_addr, "--replay-buffer", buffer_addr,
             "--model-registry", registry_addr], stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            wait_port(port, 60)
            client = RolloutManagerClient(manager_addr)
            wait_for(lambda: any(w.fragments_sent >= 20 for w in client.fleet_status().workers), 90,
                     "the worker to send 20 fragments")
            (info,) = client.fleet_status().workers
            assert info.address == f"127.0.0.1:{port}" and info.num_envs == 6
            with RolloutWorkerClient(f"127.0.0.1:{port}") as control:
                status = control.status(timeout=5)
            assert status.worker_id == info.worker_id and status.num_envs == 6 and status.env_steps > 0
            envs = children(proc.pid) - {proc.pid}
            assert len([p for p in envs if alive(p)]) >= 2  # the env processes (and the resource tracker)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    m = re.search(r"sender flushed: True \((\d+) complete fragments, (\d+) acknowledged, 0 rejected.*; stopping threw "
                  r"away (\d+) env steps \((\d+) of partial fragments, 0 fragments unacknowledged\)", text)
    assert m, text[-3000:]
    complete, acked, thrown_away, partial = (int(g) for g in m.groups())
    assert complete == acked == cluster.stats().inserted_fragments >= 20
    fleet = client.fleet_status()
    assert not fleet.workers  # deregistered
    # the worker finished every fragment under way before it stopped (CartPole: within milliseconds),
    # and what a stop costs reaches the manager with the last heartbeat, counted after Deregister
    assert fleet.preempted_env_steps == thrown_away == partial == 0
    assert fleet.env_steps == acked * T
    time.sleep(0.5)
    assert not [p for p in envs if alive(p)], "env processes outlived the worker"
