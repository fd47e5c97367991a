"""`overworld serve rollout-worker` as its own process: SIGTERM mid-run flushes every complete
fragment to the replay buffer, deregisters, and leaves no env process behind; with the replay buffer
away at that moment (its pod handing over), the worker waits for it up to its flush timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_worker.client import RolloutWorkerClient
from overworld.rollout_worker.process import FINISH_SECONDS
from tests.rollout_worker.conftest import Cluster, T
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


def start_worker(cluster: Cluster, port: int, log_file: BinaryIO, *flags: str) -> subprocess.Popen[bytes]:
    manager_addr, buffer_addr, registry_addr = cluster.addresses
    env = {**os.environ, "OVERWORLD_LOG_FORMAT": "text", "PYTHONPATH": str(ROOT / "services")}
    return subprocess.Popen(
        [sys.executable, "-m", "overworld.cli", "serve", "rollout-worker", "--host", "127.0.0.1", "--port",
         str(port), "--metrics-port", "0", "--rollout-manager", manager_addr, "--replay-buffer", buffer_addr,
         "--model-registry", registry_addr, *flags], stdout=log_file, stderr=subprocess.STDOUT, env=env)


# the worker's last log line: every complete fragment acknowledged, nothing rejected or left unacknowledged
FLUSHED = re.compile(r"sender flushed: True \((\d+) complete fragments, (\d+) acknowledged, 0 rejected.*; stopping "
                     r"threw away (\d+) env steps \((\d+) of partial fragments, 0 fragments unacknowledged\)")


def test_sigterm_flushes_complete_fragments_and_deregisters(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster(rollout_config={"to_send_queue_size": 2,
                                           "worker_config": {"num_envs": 6, "num_env_processes": 2}})
    port = free_port()
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log_file:
        proc = start_worker(cluster, port, log_file)
        try:
            wait_port(port, 60)
            client = RolloutManagerClient(cluster.addresses[0])
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
    m = FLUSHED.search(text)
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


def test_sigterm_while_the_replay_buffer_is_away_waits_for_it(make_cluster, tmp_path: Path) -> None:
    """A worker preempted while the replay buffer's pod hands over (both on spot nodes) keeps what it
    holds until the buffer is back, within its --flush-timeout, and then hands it all in."""
    cluster = make_cluster(rollout_config={"to_send_queue_size": 2,
                                           "worker_config": {"num_envs": 4, "num_env_processes": 2}})
    port = free_port()
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log_file:
        proc = start_worker(cluster, port, log_file, "--flush-timeout", "40")
        try:
            wait_port(port, 60)
            client = RolloutManagerClient(cluster.addresses[0])
            wait_for(lambda: any(w.fragments_sent >= 6 for w in client.fleet_status().workers), 90,
                     "the worker to send 6 fragments")
            cluster.bs.stop(0)
            time.sleep(3.0)  # the worker's queue fills while the buffer is away
            proc.send_signal(signal.SIGTERM)
            time.sleep(FINISH_SECONDS + 4.0)  # past the fragments' finish: the worker waits on the buffer alone
            assert proc.poll() is None, log_path.read_text()[-3000:]
            cluster.serve_buffer_again()
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    m = FLUSHED.search(log_path.read_text())
    assert m, log_path.read_text()[-3000:]
    complete, acked = int(m.group(1)), int(m.group(2))
    assert complete == acked == cluster.stats().inserted_fragments > 6
