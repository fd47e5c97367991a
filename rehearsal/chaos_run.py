"""Drive an `overworld run` and kill its services one after another with SIGKILL: the chaos test
(tests/chaos/test_chaos.py) and the recovery benchmark (bench/bench_recovery.py) share this.

`ChaosRun` starts the run as a subprocess and watches it from outside, as an operator would (with the
run's `operator` certificate, <workdir>/tls/operator: `overworld run` speaks mutual TLS): where each
service is (the launcher's services.json), the fleet's env steps (rollout-manager) and the latest
model version (model-registry), sampled every WATCH_SECONDS into `observations`. `kill_and_recover`
kills one service and measures, from the kill, the first successful call to the service started in
its place (`first_call_seconds`) and the moment the run made progress again: a newer model version
and more env steps than when it was restarted (`progress_seconds`). `wait_for_moment` picks when,
from a seeded random generator, inside the window that matters for the service: the registry just
after a version appeared (its push under way), the trainer around a checkpoint, the others at a
random instant of their steady work (the buffer is always mid-insert, gae mid-estimate).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from overworld.core.grpc_util import CHANNEL_OPTIONS
from overworld.core.security import tls
from overworld.gae.client import GaeClient
from overworld.launch.restarts import read_services
from overworld.model_registry.client import ModelRegistryClient
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_worker.client import RolloutWorkerClient
from overworld.trainer.client import TrainerClient

ROOT = Path(__file__).resolve().parents[1]
KILL_ORDER = ("gae", "replay-buffer", "model-registry", "rollout-manager", "rollout-worker#0", "trainer")
WATCH_SECONDS = 0.2
PROBE_TIMEOUT = 1.0


PROBE_BATCH = {"reward": np.ones((1, 4), np.float32), "value": np.zeros((1, 4), np.float32),
               "bootstrap_value": np.zeros((1, 4), np.float32), "terminated": np.zeros((1, 4), bool),
               "truncated": np.zeros((1, 4), bool), "next_value": np.zeros(1, np.float32)}


def identity_channel(address: str, tls_root: Path, peer: str, identity: str = "operator") -> grpc.Channel:
    """A channel as one of the run's identities (its certificates under `tls_root`) to the service `peer`;
    plaintext when the run has none (--insecure)."""
    if not (tls_root / identity / tls.CERT).exists():
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return tls.ReloadingChannel(address, tls.CredentialFiles(tls_root / identity), CHANNEL_OPTIONS, peer)


def probe(service: str, address: str, tls_root: Path) -> None:
    """One call of the service's own API at `address` (grpc.RpcError if it does not answer): a status
    read as the operator, Estimate as the trainer (the only identity that may call it)."""
    name = service.split("#")[0]
    with identity_channel(address, tls_root, name, "trainer" if name == "gae" else "operator") as ch:
        if name == "gae":
            GaeClient(address, channel=ch).estimate(PROBE_BATCH, 0.9, 0.9, timeout=PROBE_TIMEOUT)
        elif name == "model-registry":
            ModelRegistryClient(address, channel=ch).list_versions(timeout=PROBE_TIMEOUT)
        elif name == "rollout-manager":
            RolloutManagerClient(address, channel=ch).fleet_status(timeout=PROBE_TIMEOUT)
        elif name == "replay-buffer":
            ReplayBufferClient(address, channel=ch).stats(timeout=PROBE_TIMEOUT)
        elif name == "trainer":
            TrainerClient(address, channel=ch).status(timeout=PROBE_TIMEOUT)
        elif name == "rollout-worker":
            RolloutWorkerClient(address, channel=ch).status(timeout=PROBE_TIMEOUT)
        else:
            raise ValueError(f"no probe for {service}")


@dataclass
class Recovery:
    service: str
    killed_pid: int
    restarted_pid: int
    at_env_steps: int
    at_model_version: int
    first_call_seconds: float  # kill -> first successful call to the restarted service
    progress_seconds: float  # kill -> a newer model version and more env steps than at the restart


@dataclass
class Observation:
    seconds: float
    env_steps: int | None
    episodes: int | None
    model_version: int | None


class ChaosRun:
    def __init__(self, config: str | Path, workdir: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.tls_root = workdir / "tls"  # the run's certificates, made before its services start
        workdir.mkdir(parents=True, exist_ok=True)
        self.summary_path = workdir / "summary.json"
        cmd = [sys.executable, "-m", "overworld.cli", "run", str(config), "--workdir", str(workdir),
               "--summary", str(self.summary_path), *args]
        self.log = open(workdir / "stdout.log", "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        self.started = time.monotonic()
        self.observations: list[Observation] = []
        self.recoveries: list[Recovery] = []
        self._stop = threading.Event()
        self._latest = Observation(0.0, None, None, None)
        self._observe_lock = threading.Lock()
        self._channels: list[grpc.Channel] = []
        self._clients: tuple[RolloutManagerClient, ModelRegistryClient] | tuple[()] = ()
        self._watcher = threading.Thread(target=self._watch, name="chaos-watch", daemon=True)
        self._watcher.start()

    # -- what the run looks like from outside --------------------------------------------------------
    def services(self) -> dict[str, dict[str, Any]]:
        try:
            return read_services(self.workdir)["services"]
        except (OSError, ValueError, KeyError):
            return {}

    def observe(self) -> Observation:
        """Read the fleet's env steps and episodes (rollout-manager) and the latest model version
        (model-registry) now; None for a service that does not answer. One reader at a time, so
        `observations` is in the order things were seen."""
        with self._observe_lock:
            found = self.services()
            if not self._clients and "rollout-manager" in found and "model-registry" in found:
                manager_at, registry_at = found["rollout-manager"]["address"], found["model-registry"]["address"]
                self._channels = [identity_channel(manager_at, self.tls_root, "rollout-manager"),
                                  identity_channel(registry_at, self.tls_root, "model-registry")]
                self._clients = (RolloutManagerClient(manager_at, channel=self._channels[0]),
                                 ModelRegistryClient(registry_at, channel=self._channels[1]))
            steps = episodes = version = None
            if self._clients:
                manager, registry = self._clients
                with contextlib.suppress(grpc.RpcError):
                    fleet = manager.fleet_status(timeout=1)
                    steps, episodes = fleet.env_steps, fleet.episodes
                with contextlib.suppress(grpc.RpcError):
                    version = max((v.version for v in registry.list_versions(timeout=1)), default=0)
            seen = Observation(round(time.monotonic() - self.started, 2), steps, episodes, version)
            if self._clients:
                self.observations.append(seen)
            last = self._latest
            self._latest = Observation(seen.seconds, last.env_steps if steps is None else steps,
                                       last.episodes if episodes is None else episodes,
                                       last.model_version if version is None else version)
            return seen

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_SECONDS):
            self.observe()

    @property
    def env_steps(self) -> int:
        return self._latest.env_steps or 0

    @property
    def model_version(self) -> int:
        return self._latest.model_version or 0

    def wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended while waiting for {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, lines: int = 40) -> str:
        text = (self.workdir / "stdout.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # -- chaos ---------------------------------------------------------------------------------------
    def wait_for_moment(self, service: str, rng: random.Random, save_interval: int, timeout: float = 240.0) -> str:
        """Wait for a random moment inside `service`'s window; says which."""
        version = self.model_version
        if service == "model-registry":  # a version just appeared: the workers are fetching it
            self.wait_for(lambda: self.model_version > version, timeout, "a new version")
            delay = rng.uniform(0.0, 0.5)
            what = f"{delay:.2f}s after version {self.model_version} appeared (mid-push)"
        elif service == "trainer":  # the trainer writes a checkpoint with every save_interval-th version
            target = (version // save_interval + 1) * save_interval - 1
            self.wait_for(lambda: self.model_version >= target, timeout, f"version {target}")
            delay = rng.uniform(0.0, 2.0)
            what = f"{delay:.2f}s after version {self.model_version} (the next one is checkpointed)"
        else:
            delay = rng.uniform(0.0, 3.0)
            what = f"at a random instant, {delay:.2f}s on"
        time.sleep(delay)
        return what

    def wait_progress(self, steps: int, version: int, timeout: float, what: str) -> None:
        """Until the run has a newer model version and more env steps than these."""
        self.wait_for(lambda: self.model_version > version and self.env_steps > steps, timeout, what)

    def kill_and_recover(self, service: str, timeout: float = 240.0) -> Recovery:
        """SIGKILL `service`; wait until the launcher restarted it, it answers, and the run went on."""
        before = self.services()[service]
        self.observe()  # where the run is at the kill, read now
        steps, version = self.env_steps, self.model_version
        os.kill(before["pid"], signal.SIGKILL)
        killed = time.monotonic()
        self.wait_for(lambda: self.services().get(service, {}).get("pid", before["pid"]) != before["pid"], timeout,
                      f"restart of {service}")
        after = self.services()[service]
        # Progress counts from here: the launcher has killed what the dead service left (a killed trainer's
        # Ray workers could still publish a version the moment after the kill).
        self.observe()
        steps, version = max(steps, self.env_steps), max(version, self.model_version)
        first_call: float | None = None
        while first_call is None:
            try:
                probe(service, after["address"], self.tls_root)
                first_call = time.monotonic() - killed
            except grpc.RpcError:
                self.wait_for(lambda: time.monotonic() - killed < timeout, timeout, f"an answer from {service}")
                time.sleep(0.02)
        self.wait_progress(steps, version, timeout,
                           f"progress after killing {service} (at {steps} env steps, model version {version})")
        recovery = Recovery(service, before["pid"], after["pid"], steps, version, round(first_call, 3),
                            round(time.monotonic() - killed, 3))
        self.recoveries.append(recovery)
        return recovery

    def finish(self, timeout: float) -> dict[str, Any]:
        """Wait for the run to end; its summary."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end within {timeout:.0f}s:\n{self.tail()}") from None
        return json.loads(self.summary_path.read_text())

    def progress(self) -> list[dict[str, Any]]:
        path = self.workdir / "progress.jsonl"
        points = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                points.append(json.loads(line))
            except json.JSONDecodeError:  # the line being written
                break
        return points

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(5)
        for ch in self._channels:
            ch.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the launcher stops every service, then itself
            try:
                self.proc.wait(240)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def report(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.recoveries]
