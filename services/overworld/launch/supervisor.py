"""The services of a run as child processes: started on loopback (each as its own identity under mutual
TLS), waited for until healthy, restarted when they exit as a Deployment would (restarts.py), and
stopped in the order that lets the trainer checkpoint. A service that exits EXIT_CONFIG (the user's
code failed, or the config cannot work) is never restarted: the run ends with the record it logged."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from overworld.core.config import RunConfig
from overworld.core.grpc_util import channel, serving
from overworld.core.net import free_port, reserve_port
from overworld.core.security import tls
from overworld.core.service import EXIT_CONFIG, PARENT_PID_ENV
from overworld.launch.credentials import RunSecurity
from overworld.launch.processes import descendants, kill_if_same
from overworld.launch.restarts import SERVICES_FILE, RestartPolicy, write_services
from overworld.launch.service_logs import refusal, tail

ROLLOUT_SIDE = ("rollout-manager", "model-registry", "replay-buffer", "gae")
# A local run stops its workers after the trainer: the replay buffer's rate limiter then admits only
# what its error budget allows, and a worker waiting the service default (30 s) for acknowledgements
# that cannot come made every `overworld run` end half a minute late.
WORKER_FLUSH_SECONDS = 5.0
HEALTH_POLL_SECONDS = 0.1


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path
    log_file: IO[bytes] = field(repr=False)
    started: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # exited: when it is started again
    serving_unix: float | None = None  # when it first answered its health check as SERVING


class ServiceFailed(RuntimeError):
    """A service that will not be started again: it refused to run as configured (EXIT_CONFIG), or
    crashed too often in a row. The message carries what its log says about why."""

    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.service = child.name
        self.exit_code = child.proc.returncode


def refused(child: Child) -> ServiceFailed:
    """The failure of a service that exited EXIT_CONFIG, with the record it logged (the user's
    traceback), or its last lines when it wrote none."""
    record = refusal(child.log_path)
    if record is not None:
        return ServiceFailed(child, f"{child.name} cannot run as configured (exit code {EXIT_CONFIG}: not restarted, "
                                    f"it would fail the same way); {child.log_path}:\n{record}")
    return ServiceFailed(child, f"{child.name} refused its configuration (exit code {EXIT_CONFIG}); last lines of "
                                f"{child.log_path}:\n" + tail(child.log_path))


def announce(message: str) -> None:
    print(message, flush=True)


class Supervisor:
    def __init__(self, config: RunConfig, workdir: Path, config_path: Path,
                 security: RunSecurity | None = None, policy: RestartPolicy | None = None) -> None:
        self.config = config
        self.workdir = workdir
        self.config_path = config_path
        self.security = security
        self.children: list[Child] = []
        self.addresses: dict[str, str] = {}
        self.flags: dict[str, tuple[str, ...]] = {}
        self.policy = policy or RestartPolicy()
        self.family: dict[int, list[tuple[int, str]]] = {}
        self.extra_env: dict[str, str] = {}  # for every service started (overworld.online's import path)
        self.services_file = SERVICES_FILE
        self.announce: Callable[[str], None] = announce  # lines for the user (the run's progress display)

    @property
    def restarts(self) -> dict[str, int]:
        return self.policy.totals()

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def start(self, name: str, *flags: str, port: int | None = None, first_start: tuple[str, ...] = ()) -> Child:
        """Start a service (as its own identity under mutual TLS); a restart later gives it the same
        port, identity and `flags` (not `first_start`)."""
        port = port or (port_of(self.addresses[name]) if name in self.addresses else free_port())
        self.flags[name] = flags
        address = f"127.0.0.1:{port}"
        log_path = self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        # PARENT_PID_ENV: a service stops when this launcher dies, even by SIGKILL (core/service.py)
        env = {**os.environ, **self.extra_env, "OVERWORLD_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1",
               PARENT_PID_ENV: str(os.getpid())}
        service = name.split("#")[0]
        env.update(self.security.env(service) if self.security else {"OVERWORLD_INSECURE": "1"})
        if not self.security:
            env.pop(tls.TLS_DIR_ENV, None)
        cmd = [sys.executable, "-m", "overworld.cli", "serve", service, "--host", "127.0.0.1", "--port", str(port),
               "--metrics-port", "0", "--workdir", str(self.workdir), *flags, *first_start]
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        child = Child(name, address, proc, log_path, log_file)
        self.children.append(child)
        self.addresses[name] = address
        self.announce(f"  {name:<18} {address:<18} pid {proc.pid:<8} log {log_path}")
        self.write_services()
        return child

    def write_services(self, running: bool = True) -> None:
        """services.json: where each service is and how often it was restarted (`overworld status`)."""
        restarts = self.restarts
        write_services(self.workdir, self.config.run_id, {
            c.name: {"address": c.address, "pid": c.proc.pid, "restarts": restarts.get(c.name, 0),
                     "log": str(c.log_path), "exit_code": c.proc.poll()} for c in self.children}, running,
            self.services_file)

    def remember_families(self) -> None:
        """Note every service's descendants: once a service dies, its orphans are found only here."""
        for c in self.children:
            if c.proc.poll() is None:
                self.family[c.proc.pid] = descendants(c.proc.pid)

    def supervise(self) -> None:
        """Restart every service that exited, as a Deployment would (restarts.py). ServiceFailed when one
        refused its configuration (EXIT_CONFIG: a restart would fail the same way) or crashed too often
        in a row."""
        now = time.monotonic()
        for c in self.dead():
            if c.restart_at is None:
                if c.proc.returncode == EXIT_CONFIG:
                    raise refused(c)
                delay = self.policy.on_exit(c.name, c.proc.returncode, now - c.started)
                if delay is None:
                    raise ServiceFailed(c, f"{c.name} exited with code {c.proc.returncode}, "
                                           f"{self.policy.max_restarts + 1} times in a row; last lines of "
                                           f"{c.log_path}:\n" + tail(c.log_path))
                c.restart_at = now + delay
                self.announce(f"{c.name} exited with code {c.proc.returncode}; restarting it"
                              + (f" in {delay:.0f}s (crash loop)" if delay else ""))
            if now >= c.restart_at:
                self.restart(c)

    def check_refusals(self) -> None:
        """ServiceFailed for the first service that exited EXIT_CONFIG."""
        for c in self.dead():
            if c.proc.returncode == EXIT_CONFIG:
                raise refused(c)

    def restart(self, child: Child) -> Child:
        """Start an exited service again on the same port, as a Deployment's restart would (its
        leftover processes, e.g. Ray workers of a killed trainer, are killed first)."""
        for pid, started in self.family.pop(child.proc.pid, []):
            kill_if_same(pid, started)
        child.log_file.close()
        self.children.remove(child)
        self.policy.restarted(child.name)
        flags = self.flags[child.name]
        if child.name == "trainer" and "--resume" not in flags:
            flags = (*flags, "--resume", "auto")  # continue this run, not start it over
        return self.start(child.name, *flags, port=port_of(child.address))

    def start_all(self, resume: str | None = None) -> None:
        """Every service at once, on ports held from the start: each waits for the ones it needs by
        itself (the trainer, started first, starts Ray meanwhile), so nobody idles while another
        imports. Then wait until all of them answer their health checks."""
        self.announce("starting services:")
        held = self.hold_ports(("trainer", *ROLLOUT_SIDE))
        try:
            self.start_trainer(resume)
            self.start_rollout_side(wait=False)
            self.wait_healthy((*ROLLOUT_SIDE, "trainer"), 120)
        finally:
            for sock in held:
                sock.close()

    def hold_ports(self, names: tuple[str, ...]) -> list[socket.socket]:
        """A loopback port for each of these services not started yet, its address known before it starts
        and held until the caller closes the sockets (Ray, starting meanwhile, binds ports too)."""
        held = []
        for name in names:
            if name not in self.addresses:
                held.append(reserve_port())
                self.addresses[name] = f"127.0.0.1:{held[-1].getsockname()[1]}"
        return held

    def start_rollout_side(self, workers: bool = True, wait: bool = True) -> None:
        """Everything but the trainer (what overworld.online.start_rolloutmanager keeps running), at once."""
        held = self.hold_ports(ROLLOUT_SIDE)
        try:
            a = self.addresses
            db = self.config.rollout_config.replay_buffer_config.database_config
            # With the run's blobs in S3 the registry keeps its versions there too, beside the fragments.
            registry_blobs = (f"{db.blobs.rstrip('/')}/{self.config.run_id}/registry"
                              if db.blobs.startswith("s3://") else "")
            # A new `overworld run` (or --resume) starts a new fleet; a restarted manager restores it.
            self.start("rollout-manager", "--config", str(self.config_path), first_start=("--fresh-state",))
            self.start("model-registry", *(["--blobs", registry_blobs] if registry_blobs else []))
            self.start("replay-buffer", "--rollout-manager", a["rollout-manager"])
            self.start("gae")
            if wait:
                self.wait_healthy(ROLLOUT_SIDE, 120)
        finally:
            for sock in held:
                sock.close()
        if workers:
            self.start_workers()

    def start_trainer(self, resume: str | None = None, *extra: str) -> Child:
        a = self.addresses
        return self.start("trainer", "--rollout-manager", a["rollout-manager"], "--replay-buffer", a["replay-buffer"],
                          "--gae", a["gae"], "--model-registry", a["model-registry"],
                          *(["--resume", resume] if resume else []), *extra)

    def start_workers(self) -> None:
        a = self.addresses
        for i in range(self.config.rollout_config.num_rollout_workers):
            self.start(f"rollout-worker#{i}", "--rollout-manager", a["rollout-manager"],
                       "--replay-buffer", a["replay-buffer"], "--model-registry", a["model-registry"],
                       "--flush-timeout", str(WORKER_FLUSH_SECONDS))

    def wait(self, name: str, timeout: float) -> None:
        self.wait_healthy((name,), timeout)

    def wait_healthy(self, names: Iterable[str], timeout: float) -> None:
        """Wait until each of `names` answers its health check as SERVING, all of them at once (each
        child's `serving_unix` says when). RuntimeError when one exits first or is not healthy in time;
        ServiceFailed at once when any service refused its configuration meanwhile."""
        deadline = time.monotonic() + timeout
        waiting = {name: self.child(name) for name in names}
        channels = {name: channel(child.address, name.split("#")[0]) for name, child in waiting.items()}
        try:
            while waiting:
                self.check_refusals()
                for name, child in list(waiting.items()):
                    if child.proc.poll() is not None:
                        raise RuntimeError(f"{name} exited with code {child.proc.returncode}; see {child.log_path}:\n"
                                           + tail(child.log_path))
                    if serving(channels[name]):
                        child.serving_unix = time.time()
                        del waiting[name]
                if waiting and time.monotonic() > deadline:
                    raise RuntimeError(f"{', '.join(waiting)} not healthy after {timeout}s; see "
                                       + ", ".join(str(c.log_path) for c in waiting.values()))
                if waiting:
                    time.sleep(HEALTH_POLL_SECONDS)
        finally:
            for ch in channels.values():
                ch.close()

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def stop(self, after_training: Callable[[], None] | None = None,
             before_trainer: Callable[[], None] | None = None) -> None:
        """The workers first (they finish the fragments under way, flush them and report their last
        counts), then `before_trainer` (the learner trains on what the buffer holds), then the trainer
        (it checkpoints after its current iteration, or stops waiting for a batch that will not come),
        then `after_training` (the services still answer: the run's final counts are read there), then
        the rest; SIGKILL whatever lingers, descendants included (Ray's raylet and workers, env
        processes). A second Ctrl-C skips the graceful part but still leaves no process behind."""
        self.remember_families()
        family = {c.proc.pid: self.family.get(c.proc.pid, []) for c in self.children}
        try:
            workers = [c for c in self.children if c.name.startswith("rollout-worker")]
            trainer = [c for c in self.children if c.name == "trainer"]
            for group in (workers, trainer, self.children):
                if group is trainer and before_trainer is not None and any(c.proc.poll() is None for c in trainer):
                    before_trainer()
                if group is self.children and after_training is not None:
                    after_training()
                for c in group:
                    if c.proc.poll() is None:
                        c.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + (150 if group and group[0].name == "trainer" else 40)
                for c in group:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except KeyboardInterrupt:
            self.announce("interrupted again: killing every service now")
        finally:
            for c in self.children:
                alive = c.proc.poll() is None
                for pid, started in [*family[c.proc.pid], *(descendants(c.proc.pid) if alive else [])]:
                    kill_if_same(pid, started)
                if alive:
                    c.proc.kill()
                c.proc.wait()
                c.log_file.close()
            self.write_services(running=False)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])
