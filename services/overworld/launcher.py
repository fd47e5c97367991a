"""`overworld run`: every service as its own process on loopback, live progress, a JSON summary."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc

from overworld.core import authz, tls
from overworld.core.config import ConfigError, RunConfig, check_generators, load_config, to_yaml
from overworld.core.grpc_util import channel, wait_healthy
from overworld.core.net import free_port, reserve_port
from overworld.core.service import EXIT_CONFIG, PARENT_PID_ENV
from overworld.envs.crafter_score import score_summary
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.restarts import SERVICES_FILE, RestartPolicy, write_services
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.v1 import replay_buffer_pb2, trainer_pb2, trainer_pb2_grpc

ROLLOUT_SIDE = ("rollout-manager", "model-registry", "replay-buffer", "gae")
# A local run stops its workers after the trainer: the replay buffer's rate limiter then admits only
# what its error budget allows, and a worker waiting the service default (30 s) for acknowledgements
# that cannot come made every `overworld run` end half a minute late.
WORKER_FLUSH_SECONDS = 5.0


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path
    log_file: IO[bytes] = field(repr=False)
    started: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # exited: when it is started again


class Launcher:
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

    @property
    def restarts(self) -> dict[str, int]:
        return self.policy.totals()

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
        print(f"  {name:<18} {address:<18} pid {proc.pid:<8} log {log_path}", flush=True)
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
        """Restart every service that exited, as a Deployment would (restarts.py); RuntimeError when
        one crashed too often in a row."""
        now = time.monotonic()
        for c in self.dead():
            if c.restart_at is None:
                if c.proc.returncode == EXIT_CONFIG:  # a restart would only fail the same way
                    raise RuntimeError(f"{c.name} refused its configuration (exit code {EXIT_CONFIG}); last lines "
                                       f"of {c.log_path}:\n" + tail(c.log_path))
                delay = self.policy.on_exit(c.name, c.proc.returncode, now - c.started)
                if delay is None:
                    raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}, {self.policy.max_restarts + 1} "
                                       f"times in a row; last lines of {c.log_path}:\n" + tail(c.log_path))
                c.restart_at = now + delay
                print(f"\n{c.name} exited with code {c.proc.returncode}; restarting it"
                      + (f" in {delay:.0f}s (crash loop)" if delay else ""), flush=True)
            if now >= c.restart_at:
                self.restart(c)

    def restart(self, child: Child) -> Child:
        """Start an exited service again on the same port, as a Deployment's restart would (its
        leftover processes, e.g. Ray workers of a killed trainer, are killed first)."""
        for pid, started in self.family.pop(child.proc.pid, []):
            kill_if_same(pid, started)
        child.log_file.close()
        self.children.remove(child)
        self.policy.restarted(child.name)
        port = port_of(child.address)
        flags = self.flags[child.name]
        if child.name == "trainer" and "--resume" not in flags:
            flags = (*flags, "--resume", "auto")  # continue this run, not start it over
        return self.start(child.name, *flags, port=port)

    def start_all(self, resume: str | None = None) -> None:
        """Every service at once, on ports held from the start: each waits for the ones it needs by
        itself (the trainer, started first, starts Ray meanwhile), so nobody idles while another
        imports. Then wait until all of them answer their health checks."""
        print("starting services:", flush=True)
        held = self.hold_ports(("trainer", *ROLLOUT_SIDE))
        try:
            self.start_trainer(resume)
            self.start_rollout_side(wait=False)
            for name in (*ROLLOUT_SIDE, "trainer"):
                self.wait(name, 120)
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
                for name in ROLLOUT_SIDE:
                    self.wait(name, 120)
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
        child = next(c for c in self.children if c.name == name)
        deadline = time.monotonic() + timeout
        while True:
            if child.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {child.proc.returncode}; see {child.log_path}:\n"
                                   + tail(child.log_path))
            try:
                wait_healthy(child.address, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not healthy after {timeout}s; see {child.log_path}") from None

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def buffer_stats(self) -> replay_buffer_pb2.BufferStats | None:
        try:
            with ReplayBufferClient(self.addresses["replay-buffer"]) as buffer:
                return buffer.stats(5.0, retried=True)
        except (grpc.RpcError, KeyError):
            return None

    def stop(self) -> None:
        """The trainer first (it checkpoints after its current iteration, which needs the workers'
        fragments: stopped after them, it waited out its stop timeout for a batch that never came),
        then the workers (they flush), then the rest; SIGKILL whatever lingers, descendants included
        (Ray's raylet and workers, env processes). A second Ctrl-C skips the graceful part but still
        leaves no process behind."""
        self.remember_families()
        family = {c.proc.pid: self.family.get(c.proc.pid, []) for c in self.children}
        try:
            workers = [c for c in self.children if c.name.startswith("rollout-worker")]
            for group in ([c for c in self.children if c.name == "trainer"], workers, self.children):
                for c in group:
                    if c.proc.poll() is None:
                        c.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + (150 if group and group[0].name == "trainer" else 40)
                for c in group:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except KeyboardInterrupt:
            print("\ninterrupted again: killing every service now", flush=True)
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


@dataclass
class RunSecurity:
    """A run's throwaway CA and certificates (<workdir>/tls/<identity>/) and its Ray token: made at
    every start (a resumed run's old services are gone), the CA's key never written."""
    identities: dict[str, Path]
    ray_token: Path

    @classmethod
    def load(cls, workdir: Path) -> RunSecurity | None:
        """The credentials a launcher made earlier in `workdir` (the rollout side's, for the trainer that
        start_trainer adds to it); None when that launcher ran --insecure."""
        root = workdir / "tls"
        if not (root / "operator" / tls.CERT).exists():
            return None
        return cls({i: root / i for i in authz.IDENTITIES}, root / "ray-auth-token")

    @classmethod
    def create(cls, workdir: Path, run_id: str) -> RunSecurity:
        root = workdir / "tls"
        identities = tls.write_run_credentials(root, run_id)
        token = root / "ray-auth-token"
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        return cls(identities, token)

    def env(self, service: str) -> dict[str, str]:
        out = {tls.TLS_DIR_ENV: str(self.identities[service])}
        if service == "trainer":  # the trainer's local Ray: token authentication with this run's token
            out.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.ray_token))
        return out


def _stat(pid: int) -> list[str] | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every process below `pid` as (pid, start time), read from /proc; the start time tells a
    reused pid from the process we saw."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child[0])
    return out


def kill_if_same(pid: int, started: str) -> None:
    fields = _stat(pid)
    if fields is not None and fields[19] == started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run(config_source: str, overrides: list[str], max_env_steps: int | None, summary_path: str | None,
        workdir: str | None, target_return: float | None, resume: str | None = None,
        progress_interval: float = 2.0, secure: bool = True) -> dict[str, Any]:
    config = load_config(config_source, overrides)
    check_generators(config)
    previous = Path(workdir, "config.yaml") if workdir else None
    if resume and previous is not None and previous.exists():
        config.run_id = load_config(previous).run_id  # same run: its checkpoints, its blobs
    elif resume and not workdir:
        raise ConfigError("--resume needs --workdir: the directory of the run to resume")
    if not config.run_id:
        config.run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    work = Path(workdir or Path("runs") / config.run_id).resolve()
    work.mkdir(parents=True, exist_ok=True)
    resolved = work / "config.yaml"
    resolved.write_text(to_yaml(config))
    print(f"overworld run {config.run_id}: workdir {work}", flush=True)
    security = RunSecurity.create(work, config.run_id) if secure else None
    # This process talks to the services as the operator (`overworld status` can, with --tls-dir).
    tls.use(security.identities["operator"] if security else None)
    print(f"  mutual TLS: certificates in {work / 'tls'}; `overworld status --tls-dir "
          f"{work / 'tls' / 'operator'}`" if security else "  --insecure: plaintext gRPC, no authorization",
          flush=True)
    launcher = Launcher(config, work, resolved, security)

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # one graceful path for Ctrl-C, SIGTERM and SIGHUP: no orphans

    # SIGINT too: a shell starts a background command (`overworld run ... &` in a script, CI) with
    # SIGINT ignored, and Python then leaves it ignored instead of raising KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    started = time.monotonic()
    summary: dict[str, Any] = {"status": "failed", "run_id": config.run_id, "workdir": str(work), "env_steps": 0,
                               "episodes": 0, "mean_return_last_100": None, "model_version": 0, "updates": 0,
                               "resumed_from": None, "start_env_steps": 0, "start_model_version": 0,
                               "steps_to_target": None}
    fleet: Any = None
    buffer: replay_buffer_pb2.BufferStats | None = None
    trainer_status: Any = None
    last_trainer_error = ""

    def offset(status: Any) -> int:
        """A resumed run's services count env steps from zero; the checkpoint knows where it was."""
        return int(status.start_env_steps) if resume and status is not None else 0

    try:
        launcher.start_all(resume)
        manager = RolloutManagerClient(launcher.addresses["rollout-manager"])
        trainer = trainer_pb2_grpc.TrainerStub(channel(launcher.addresses["trainer"]))
        is_tty = sys.stdout.isatty()
        last_print = 0.0
        while True:
            time.sleep(0.5)
            exited = next((c for c in launcher.dead() if c.name == "trainer" and c.restart_at is None), None)
            if exited is not None:
                if trainer_status is not None and trainer_status.state == "finished":
                    summary["status"] = "completed"
                    break
                if last_trainer_error and exited.proc.returncode == EXIT_CONFIG:  # not restarted: say why
                    raise RuntimeError(f"trainer exited with code {EXIT_CONFIG}: {last_trainer_error}; last lines "
                                       f"of {exited.log_path}:\n" + tail(exited.log_path))
                if last_trainer_error:
                    print(f"\ntrainer failed: {last_trainer_error.splitlines()[-1][:300]}", flush=True)
                    last_trainer_error = ""
            launcher.supervise()  # restarts whatever exited (the trainer resumes from its checkpoint)
            try:
                fleet = manager.fleet_status()
                status = trainer.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)
            except grpc.RpcError:
                continue
            if (trainer_status is not None and trainer_status.state == "running" and status.state in ("starting", "running")
                    and status.model_version < trainer_status.model_version):
                status = trainer_status  # a restarted trainer has not reported yet: the run is where it was
            trainer_status = status
            if trainer_status.state == "failed":
                # The trainer process exits next; the restart policy brings it back (it resumes from its
                # checkpoint), as a Deployment would.
                last_trainer_error = trainer_status.error
                continue
            if trainer_status.state == "finished":
                summary["status"] = "completed"
                break
            reached = (target_return is not None and fleet.episodes >= 100
                       and fleet.mean_return_last_100 >= target_return)
            now = time.monotonic()
            if now - last_print >= progress_interval or reached:
                last_print = now
                launcher.remember_families()
                record_progress(work / "progress.jsonl", now - started, offset(trainer_status) + fleet.env_steps,
                                fleet, trainer_status)
                line = progress_line(fleet, trainer_status, now - started, max_env_steps, offset(trainer_status))
                print(("\r" + line) if is_tty else line, end="" if is_tty else "\n", flush=True)
            if reached:
                summary["status"] = "target_reached"
                summary["steps_to_target"] = offset(trainer_status) + fleet.env_steps
                summary["target_reached_unix"] = time.time()
                break
            if max_env_steps is not None and offset(trainer_status) + fleet.env_steps >= max_env_steps:
                summary["status"] = "max_env_steps"
                break
        buffer = launcher.buffer_stats()  # before the buffer stops: its counters go in the summary
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
    except RuntimeError as err:
        summary["status"] = "failed"
        summary["error"] = str(err)
        print(f"\nerror: {err}", file=sys.stderr, flush=True)
    finally:
        print("\nstopping services...", flush=True)
        launcher.stop()
        tls.reset()
    wall = time.monotonic() - started
    if fleet is not None:
        summary.update(env_steps=offset(trainer_status) + fleet.env_steps, episodes=fleet.episodes,
                       mean_return_last_100=fleet.mean_return_last_100 if fleet.episodes else None,
                       fragments_acknowledged=fleet.fragments_sent, fragments_lost=fleet.fragments_lost,
                       tasks={t.task: {"episodes": t.episodes, "mean_return_last_100": t.mean_return_last_100,
                                       "mean_length_last_100": t.mean_length_last_100,
                                       **dict(t.mean_extras_last_100),
                                       **({"crafter": c} if (c := score_summary(t.total_extras, t.episodes)) else {})}
                                   for t in fleet.tasks})
    if trainer_status is not None:
        summary.update(model_version=trainer_status.model_version, updates=trainer_status.updates,
                       iterations=trainer_status.iteration, samples_trained=trainer_status.samples_trained,
                       resumed_from=trainer_status.resumed_from or None,
                       start_env_steps=trainer_status.start_env_steps if resume else 0,
                       start_model_version=trainer_status.start_model_version,
                       start_rho=trainer_status.start_rho, latest_checkpoint=trainer_status.latest_checkpoint or None)
    if buffer is not None:
        summary["replay_buffer"] = {"inserted_fragments": buffer.inserted_fragments, "fragments": buffer.fragments,
                                    "chunks": buffer.chunks, "sampled_chunks": buffer.sampled_chunks,
                                    "dropped_chunks": dict(buffer.dropped_chunks)}
    summary["restarts"] = launcher.restarts
    summary["wall_seconds"] = round(wall, 2)
    run_steps = summary["env_steps"] - summary.get("start_env_steps", 0)  # a resumed run: only its own steps
    summary["env_steps_per_second"] = round(run_steps / wall, 1) if wall > 0 else 0.0
    if summary_path:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_path).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("status", "env_steps", "episodes", "mean_return_last_100",
                                              "model_version", "updates", "wall_seconds")}), flush=True)
    return summary


def record_progress(path: Path, elapsed: float, env_steps: int, fleet: Any, trainer: Any) -> None:
    """One JSON line per progress tick: the learning curve against env steps and wall time."""
    entry = {"wall_seconds": round(elapsed, 2), "env_steps": env_steps, "episodes": fleet.episodes,
             "mean_return_last_100": fleet.mean_return_last_100 if fleet.episodes else None,
             "model_version": trainer.model_version, "updates": trainer.updates,
             **{f"{t.task}/{k}": v for t in fleet.tasks for k, v in t.mean_extras_last_100.items()
                if k in ("cows_eaten", "achievement_eat_cow")},
             **{f"{t.task}/crafter_score": c["score"] for t in fleet.tasks
                if (c := score_summary(t.total_extras, t.episodes))},
             **{k: round(v, 4) for k, v in trainer.metrics.items() if k.endswith("_seconds")}}  # the last iteration's
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def progress_line(fleet: Any, trainer: Any, elapsed: float, max_env_steps: int | None, offset: int = 0) -> str:
    steps = offset + fleet.env_steps
    of = f"/{max_env_steps:,}" if max_env_steps else ""
    versions = [w.model_version for w in fleet.workers]
    # Workers can be ahead of the trainer's last status: they read a version from the registry first.
    lag = max(0.0, trainer.model_version - sum(versions) / len(versions)) if versions else 0.0
    ret = f"{fleet.mean_return_last_100:8.2f}" if fleet.episodes else "     n/a"
    return (f"[{elapsed:6.0f}s] env steps {steps:>10,}{of}  {steps / max(elapsed, 1e-9):7.0f}/s  "
            f"episodes {fleet.episodes:>6}  return(100) {ret}  model v{trainer.model_version:<5} "
            f"updates {trainer.updates:<6} lag {lag:4.1f}  workers {len(fleet.workers)}")
