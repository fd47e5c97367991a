"""GPU placement on a real multi-node Ray cluster on this CPU machine: a head that declares 0 GPUs
(a KubeRay head pod) and, later, a second node started with `--num-gpus 1`. Whether a trainer worker
gets a GPU follows train_config.num_gpus_per_worker and the cluster, never the driver's own hardware:
without the GPU node the run stops at once with how many GPUs were asked and how many the cluster
has; with it, the worker lands on that node with Ray's GPU, and since CUDA cannot be used there (this
machine has none) that is an error too, never a CPU run.

Both nodes are `ray start --block` processes on loopback with ports, a temp dir and an auth token of
their own (Ray's token auth is on by default; the shared ~/.ray/auth_token is left alone), stopped by
PID at the end (never `ray stop`: other people's Ray runs on this machine too)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from overworld.core.config import load_config
from overworld.trainer.learner import PPOLearner
from overworld.trainer.placement import PlacementError
from tests.support import alive, free_port, stop_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


class LocalRayCluster:
    def __init__(self, temp_dir: Path) -> None:
        self.temp_dir = temp_dir
        self.nodes: list[subprocess.Popen] = []
        # Nodes on their own loopback addresses: Ray turns "127.0.0.1" into the machine's primary address
        # once multi-node clusters are allowed, but leaves other loopback addresses alone.
        self.head_ip = "127.0.0.2"
        self.address = f"{self.head_ip}:{free_port()}"
        # This cluster's own token, for its nodes and for this (driver) process.
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_worker_niceness": "0"}

    def start_node(self, gpus: int, ready, head: bool = False, attempts: int = 3) -> None:  # type: ignore[no-untyped-def]
        """Start a node and wait until `ready()`. On a busy machine a raylet can miss Ray's own startup
        deadline (its dashboard agent is slow to start) and `ray start` gives up: start it again."""
        for attempt in range(1, attempts + 1):
            self._launch(gpus, head)
            try:
                self.wait_for("head" if head else "node", ready, timeout=180)
                return
            except AssertionError:
                failed = self.nodes.pop()
                stop_process(failed, timeout=30)
                if attempt == attempts:
                    raise

    def _launch(self, gpus: int, head: bool) -> None:
        ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
        node_ip = self.head_ip if head else f"127.0.0.{2 + len(self.nodes)}"
        cmd = [RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address", node_ip, "--num-cpus", "2",
               f"--num-gpus={gpus}", *[arg for flag in ports for arg in (flag, str(free_port()))]]
        if head:
            cmd += ["--head", "--port", self.address.rsplit(":", 1)[1], "--include-dashboard", "false",
                    "--ray-client-server-port", str(free_port()), "--temp-dir", str(self.temp_dir)]
        else:
            cmd += ["--address", self.address]
        log = open(self.temp_dir.parent / f"node-{node_ip}.log", "a")  # noqa: SIM115 (kept open by the node)
        # tests/conftest.py makes every Ray a single-machine one; a worker node must be allowed to join.
        env = {**os.environ, **self.env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
        self.nodes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env))

    def wait_for(self, what: str, predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"Ray cluster: no {what} after {timeout}s (logs in {self.temp_dir.parent})"
            assert all(n.poll() is None for n in self.nodes), f"a Ray node exited (logs in {self.temp_dir.parent})"
            time.sleep(0.5)

    def stop(self) -> list[int]:
        """Stop every node by PID (ray start --block takes its node's processes down with it); returns
        the PIDs of processes of this cluster still alive afterwards (killed too)."""
        for node in reversed(self.nodes):
            stop_process(node, timeout=30)
        time.sleep(1)
        leftovers = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if str(self.temp_dir) in cmdline and alive(int(proc.name)):
                    leftovers.append(int(proc.name))
                    os.kill(int(proc.name), 9)
        return leftovers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state

    c = LocalRayCluster(tmp_path_factory.mktemp("ray") / "t")  # short: Ray's socket paths are length-limited
    saved = {k: os.environ.get(k) for k in c.env}
    os.environ.update(c.env)
    reset_auth_token_state()  # Ray caches the token it read first
    def connected() -> bool:
        try:
            ray.init(address=c.address, log_to_driver=False, _node_ip_address=c.head_ip)
            return True
        except Exception:
            return False

    try:
        c.start_node(gpus=0, ready=connected, head=True)
        yield c
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reset_auth_token_state()
        assert c.stop() == [], "processes of the test's Ray cluster outlived `ray start --block`"


def trainer(*overrides: str) -> PPOLearner:
    config = load_config(ROOT / "examples/cartpole.yaml", ["train_config.num_workers=1", "run_id=placement",
                                                           *overrides])
    return PPOLearner.from_config(config, rollout_manager="", workdir=str(ROOT))


def test_gpu_workers_go_where_the_cluster_has_gpus_and_fail_clearly_otherwise(cluster: LocalRayCluster) -> None:
    import ray

    # The driver (this process) has no GPU, and that decides nothing: the config asks for one.
    asking = trainer("train_config.num_gpus_per_worker=1", "train_config.placement_timeout=3")
    started = time.monotonic()
    with pytest.raises(PlacementError) as err:
        asking.fit()
    assert time.monotonic() - started < 60
    assert "asks for 1 CPU, 1 GPU" in str(err.value) and "the Ray cluster has 2 CPU (2 free), 0 GPU" in str(err.value)
    assert "placement_timeout=3" in str(err.value)

    cluster.start_node(gpus=1, ready=lambda: ray.cluster_resources().get("GPU", 0) >= 1)
    (gpu_node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]
    with pytest.raises(PlacementError) as err:
        asking.fit()
    message = str(err.value)
    assert f"Ray assigned GPU 0 on node 127.0.0.3 ({gpu_node})" in message  # it landed on the GPU node
    assert "CUDA is not usable there" in message and "Refusing to train on CPU" in message

    # Asking for none is a CPU run by choice: nothing to reserve beyond a CPU per worker.
    from overworld.trainer.placement import reserve_workers, worker_resources

    assert reserve_workers(2, worker_resources(0), timeout=0) == []
