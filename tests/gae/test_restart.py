"""gae is stateless: a call made while it is down (killed, being restarted) is retried with backoff
and answers once a new gae is up on the same address."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from overworld.core.grpc_util import wait_healthy
from overworld.gae.client import GaeClient
from tests.gae.test_server import batch
from tests.support import free_port


def start_gae(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "overworld.cli", "serve", "gae", "--host", "127.0.0.1", "--port",
                             str(port), "--metrics-port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ})
    wait_healthy(f"127.0.0.1:{port}", timeout=60)
    return proc


@pytest.mark.slow
def test_a_call_rides_through_a_killed_and_restarted_gae() -> None:
    port = free_port()
    procs = [start_gae(port)]
    client = GaeClient(f"127.0.0.1:{port}")
    try:
        expected, _ = client.estimate(batch(), 0.5, 1.0)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        restart = threading.Timer(1.0, lambda: procs.append(start_gae(port)))
        restart.start()
        started = time.monotonic()
        adv, _ = client.estimate(batch(), 0.5, 1.0, timeout=60)  # UNAVAILABLE until the new gae is up
        assert time.monotonic() - started >= 1.0
        np.testing.assert_allclose(adv, expected)
        restart.join()
    finally:
        client.close()
        for proc in procs:
            proc.kill()
            proc.wait(10)
