"""`overworld run`: the run loop. Write the resolved config and the run's credentials to the workdir,
start every service (supervisor.py), follow the run (progress, restarts, startup milestones, the
learning curve) until it reaches its budget, finishes, fails or is interrupted, stop the services and
write the summary."""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from overworld.core.config import (
    ConfigError,
    RunConfig,
    check_generators,
    chunks_per_iteration,
    load_config,
    to_yaml,
)
from overworld.core.imports import import_object
from overworld.core.security import tls
from overworld.core.service import EXIT_CONFIG
from overworld.envs.task_metrics import declared_task_metrics
from overworld.launch import env_steps
from overworld.launch.credentials import RunSecurity
from overworld.launch.curve import append_point, curve_point, task_figures
from overworld.launch.milestones import STARTUP_POLL_SECONDS, StartupMilestones
from overworld.launch.progress import Budget, ProgressDisplay, Rate, Snapshot, format_progress, time_left
from overworld.launch.status import write_run_status
from overworld.launch.supervisor import Supervisor
from overworld.model_registry.client import ModelRegistryClient
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_worker.client import RolloutWorkerClient
from overworld.trainer.client import TrainerClient
from overworld.v1 import replay_buffer_pb2

POLL_SECONDS = 0.5
LEFT_OVER_SECONDS = 60.0  # at most this long the learner trains on what the buffer holds once the fleet stopped
LEFT_OVER_STALL = 10.0  # ... and gives up sooner when it takes nothing for this long


def prepare_workdir(config_source: str, overrides: list[str], workdir: str | None,
                    resume: str | None) -> tuple[RunConfig, Path]:
    """The validated config (its generators imported) and the run's workdir with `config.yaml`, the
    resolved config, in it. ConfigError for anything wrong with them: nothing has started yet."""
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
    (work / "config.yaml").write_text(to_yaml(config))
    return config, work


class RunClients:
    """The launcher's connections to the services it follows (as the operator identity)."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.manager = RolloutManagerClient(addresses["rollout-manager"])
        self.registry = ModelRegistryClient(addresses["model-registry"])
        self.trainer = TrainerClient(addresses["trainer"])
        worker = addresses.get("rollout-worker#0")
        self.first_worker = RolloutWorkerClient(worker) if worker else None

    def close(self) -> None:
        self.manager.close()
        self.registry.close()
        self.trainer.close()
        if self.first_worker is not None:
            self.first_worker.close()


class RunFollower:
    """Follows a started run until it ends: polls the rollout-manager and the trainer, restarts services
    that exit (the supervisor), and keeps the progress line, the learning curve, the status file and
    the startup milestones."""

    def __init__(self, config: RunConfig, supervisor: Supervisor, workdir: Path, budget: Budget, resumed: bool,
                 record_interval: float = 2.0, display: ProgressDisplay | None = None) -> None:
        self.config = config
        self.supervisor = supervisor
        self.workdir = workdir
        self.budget = budget
        self.resumed = resumed
        self.record_interval = record_interval
        self.display = display or ProgressDisplay()
        supervisor.announce = self.display.message
        self.task_metrics = declared_task_metrics(import_object(config.env_generator))
        self.started = time.monotonic()
        self.milestones = StartupMilestones(time.time(), resumed)
        self.steps_rate, self.iterations_rate = Rate(), Rate()
        self.clients: RunClients  # once the services are started (follow)
        self.fleet: Any = None
        self.trainer: Any = None  # the trainer's last status
        self.snapshot: Snapshot | None = None  # the last one shown
        self.buffer: replay_buffer_pb2.BufferStats | None = None
        self.last_trainer_error = ""
        self.last_record = 0.0
        self.outcome: dict[str, Any] = {}  # steps_to_target, target_reached_unix, wall_seconds_to_target

    def offset(self) -> int:
        """A resumed run's services count env steps from zero; the checkpoint knows where it was."""
        return int(self.trainer.start_env_steps) if self.resumed and self.trainer is not None else 0

    def env_steps(self) -> int:
        return self.offset() + (self.fleet.env_steps if self.fleet is not None else 0)

    def follow(self) -> str:
        """Until the run ends: its status (completed, target_reached, max_env_steps). ServiceFailed when
        a service cannot be restarted; the replay buffer's counters are read before it stops."""
        self.clients = RunClients(self.supervisor.addresses)
        self.milestones.observe_services(self.supervisor.children)
        try:
            status = self._follow()
            self.buffer = self.buffer_stats()
        finally:
            self.clients.close()
        return status

    def _follow(self) -> str:
        while True:
            # fast until training runs (a milestone that cannot come, as with no workers, must not keep it fast)
            time.sleep(STARTUP_POLL_SECONDS if "first_update" in self.milestones.missing() else POLL_SECONDS)
            if self.trainer_exited_finished():
                return "completed"
            self.supervisor.supervise()  # restarts whatever exited (the trainer resumes from its checkpoint)
            if not self.poll():
                continue
            if self.trainer.state == "failed":
                # The trainer process exits next; the restart policy brings it back (it resumes from its
                # checkpoint), as a Deployment would, unless it exits EXIT_CONFIG.
                self.last_trainer_error = self.trainer.error
                continue
            if self.trainer.state == "finished":
                return "completed"
            reached = (self.budget.target_return is not None and self.fleet.episodes >= 100
                       and self.fleet.mean_return_last_100 >= self.budget.target_return)
            out_of_steps = self.budget.max_env_steps is not None and self.env_steps() >= self.budget.max_env_steps
            first_reach = reached and "steps_to_target" not in self.outcome
            self.tick(time.monotonic(), force=first_reach or out_of_steps)  # the curve's point at each
            if first_reach:
                self.outcome.update(steps_to_target=self.env_steps(), target_reached_unix=time.time(),
                                    wall_seconds_to_target=round(time.monotonic() - self.started, 2))
            if reached and not self.budget.keep_going:
                return "target_reached"
            if out_of_steps:
                return "max_env_steps"

    def trainer_exited_finished(self) -> bool:
        """Whether the trainer exited after finishing (the run is complete). A trainer that exited after
        failing is said so here and restarted by the supervisor, unless it refused its configuration."""
        exited = next((c for c in self.supervisor.dead() if c.name == "trainer" and c.restart_at is None), None)
        if exited is None:
            return False
        if self.trainer is not None and self.trainer.state == "finished":
            return True
        if self.last_trainer_error and exited.proc.returncode != EXIT_CONFIG:
            self.display.message(f"trainer failed: {self.last_trainer_error.splitlines()[-1][:300]}")
            self.last_trainer_error = ""
        return False

    def poll(self) -> bool:
        """Read the fleet and the trainer's status; False when either is unreachable for now."""
        try:
            fleet = self.clients.manager.fleet_status()
            status = self.clients.trainer.status(timeout=5)
        except grpc.RpcError:
            return False
        if (self.trainer is not None and self.trainer.state == "running" and status.state in ("starting", "running")
                and status.model_version < self.trainer.model_version):
            status = self.trainer  # a restarted trainer has not reported yet: the run is where it was
        self.fleet, self.trainer = fleet, status
        return True

    def tick(self, now: float, force: bool = False) -> None:
        elapsed = now - self.started
        self.steps_rate.add(elapsed, self.env_steps())
        self.iterations_rate.add(elapsed, self.trainer.iteration)
        if self.milestones.missing():
            self.milestones.observe_run(self.fleet, self.trainer, time.time())
            self.milestones.poll(self.clients.registry, self.clients.first_worker, time.time())
        snapshot = self.snapshot = Snapshot.of(self.fleet, self.trainer, elapsed, self.offset())
        if force or now - self.last_record >= self.record_interval:
            self.last_record = now
            self.supervisor.remember_families()
            append_point(self.workdir / "progress.jsonl", curve_point(
                elapsed, snapshot.env_steps, self.fleet, self.trainer, self.task_metrics, self.push_seconds()))
            write_run_status(self.workdir, self.status_record("running", snapshot))
        if force or self.display.due(now):
            self.display.show(format_progress(snapshot, self.budget, self.steps_rate.per_second(),
                                              self.iterations_rate.per_second()), now)

    def push_seconds(self) -> float | None:
        """Publish -> every connected worker swapped it in, for the registry's latest version once pushed."""
        try:
            push = self.clients.registry.push_status(timeout=1.0)
        except grpc.RpcError:
            return None
        return push.push_seconds if push.complete and push.acked else None

    def train_on_what_is_left(self) -> None:
        """Once the workers have stopped: while the replay buffer holds an iteration's chunks, the learner
        samples on (it takes them as they come), so that what the fleet stepped is trained on rather than
        left behind; then the trainer is stopped (up to LEFT_OVER_SECONDS)."""
        need = chunks_per_iteration(self.config.train_config)
        deadline, taken_at, sampled = time.monotonic() + LEFT_OVER_SECONDS, time.monotonic(), -1
        while time.monotonic() < deadline and time.monotonic() - taken_at < LEFT_OVER_STALL:
            stats = self.buffer_stats()
            if stats is None or stats.chunks < need:
                return
            if stats.sampled_chunks != sampled:
                if sampled < 0:
                    self.display.message(f"training on the {stats.chunks} chunks left in the replay buffer...")
                taken_at, sampled = time.monotonic(), stats.sampled_chunks
            time.sleep(POLL_SECONDS)

    def read_final_counts(self) -> None:
        """Once the trainer and the workers have stopped (the workers' last heartbeats counted, the trainer's
        last checkpoint written) and before the services stop: the final counts of the fleet, the learner
        and the buffer, so that the summary's figures are of the whole run."""
        try:
            with RolloutManagerClient(self.supervisor.addresses["rollout-manager"]) as manager:
                self.fleet = manager.fleet_status(timeout=5.0)
        except (grpc.RpcError, KeyError):
            pass  # the last poll's counts stand
        self.buffer = self.buffer_stats() or self.buffer
        self.adopt_last_checkpoint()

    def adopt_last_checkpoint(self) -> None:
        """The trainer checkpoints when it stops: its counters there are newer than its last report (it
        trained on between the last poll and the stop)."""
        if self.trainer is None:
            return
        from overworld.trainer import checkpoint  # here: the launcher itself does without torch

        try:
            store = checkpoint.checkpoint_store(self.config, str(self.workdir))
            latest = store.resolve("latest")
            state = store.load(latest, []).state if latest is not None else None
        except Exception as err:  # noqa: BLE001 - any store's failure: the summary keeps the last report
            self.display.message(f"could not read the last checkpoint ({err}); the summary has the trainer's last report")
            return
        if state is not None and int(state.get("iteration", 0)) >= self.trainer.iteration:
            assert latest is not None
            self.trainer.latest_checkpoint = latest
            self.trainer.iteration, self.trainer.updates = int(state["iteration"]), int(state["updates"])
            self.trainer.samples_trained = int(state["samples_trained"])
            self.trainer.model_version = int(state["model_version"])

    def buffer_stats(self) -> replay_buffer_pb2.BufferStats | None:
        try:
            with ReplayBufferClient(self.supervisor.addresses["replay-buffer"]) as buffer:
                return buffer.stats(timeout=5.0)
        except (grpc.RpcError, KeyError):
            return None

    def status_record(self, state: str, snapshot: Snapshot | None = None) -> dict[str, Any]:
        """What `<workdir>/status.json` holds (overworld/launch/status.py): by default the last progress shown."""
        snapshot = snapshot or self.snapshot
        record: dict[str, Any] = {"run_id": self.config.run_id, "state": state,
                                  "budget": asdict(self.budget), "milestones": dict(self.milestones.reached)}
        if snapshot is not None:
            left = (time_left(snapshot, self.budget, self.steps_rate.per_second(), self.iterations_rate.per_second())
                    if state == "running" else None)
            record["progress"] = {**asdict(snapshot), "seconds_left": None if left is None else round(left, 1)}
        return record

    def summary(self, status: str, error: str | None) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        out: dict[str, Any] = {"status": status, "run_id": self.config.run_id, "workdir": str(self.workdir),
                               "env_steps": 0, "episodes": 0, "mean_return_last_100": None, "model_version": 0,
                               "updates": 0, "resumed_from": None, "start_env_steps": 0, "start_model_version": 0,
                               "steps_to_target": None, **self.outcome}
        if error is not None:
            out["error"] = error
        if self.fleet is not None:
            f = self.fleet
            out.update(env_steps=self.env_steps(), episodes=f.episodes,
                       mean_return_last_100=f.mean_return_last_100 if f.episodes else None,
                       fragments_acknowledged=f.fragments_sent, fragments_lost=f.fragments_lost,
                       preempted_env_steps=f.preempted_env_steps,
                       tasks=task_figures(f, self.task_metrics),
                       idle_share=env_steps.idle_share(f.room_wait_seconds, f.env_slot_seconds))
        if self.trainer is not None:
            t = self.trainer
            out.update(model_version=t.model_version, updates=t.updates, iterations=t.iteration,
                       samples_trained=t.samples_trained,
                       env_steps_used=round(t.samples_trained / out["env_steps"], 3) if out["env_steps"] else None,
                       env_steps_not_trained=env_steps.not_trained(self.config, out["env_steps"], t.samples_trained,
                                                                   self.buffer),
                       policy_lag=env_steps.policy_lag(t.metrics),
                       resumed_from=t.resumed_from or None,
                       start_env_steps=t.start_env_steps if self.resumed else 0,
                       start_model_version=t.start_model_version, start_rho=t.start_rho,
                       latest_checkpoint=t.latest_checkpoint or None)
        if self.buffer is not None:
            b = self.buffer
            out["replay_buffer"] = {"inserted_fragments": b.inserted_fragments, "fragments": b.fragments,
                                    "chunks": b.chunks, "sampled_chunks": b.sampled_chunks,
                                    "dropped_chunks": dict(b.dropped_chunks),
                                    "expired_reservations": b.expired_reservations}
        out["restarts"] = self.supervisor.restarts
        out["milestones"] = dict(self.milestones.reached)
        out["wall_seconds"] = round(wall, 2)
        run_steps = out["env_steps"] - out.get("start_env_steps", 0)  # a resumed run: only its own steps
        out["env_steps_per_second"] = round(run_steps / wall, 1) if wall > 0 else 0.0
        return out


def stop_on_signals() -> None:
    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # one graceful path for Ctrl-C, SIGTERM and SIGHUP: no orphans

    # SIGINT too: a shell starts a background command (`overworld run ... &` in a script, CI) with
    # SIGINT ignored, and Python then leaves it ignored instead of raising KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


def run(config_source: str, overrides: list[str], max_env_steps: int | None, summary_path: str | None,
        workdir: str | None, target_return: float | None, resume: str | None = None,
        progress_interval: float = 2.0, secure: bool = True, keep_going: bool = False) -> dict[str, Any]:
    """Train on this machine, every service its own process; the summary (also written to
    `summary_path`). `progress_interval`: seconds between two learning-curve points."""
    config, work = prepare_workdir(config_source, overrides, workdir, resume)
    print(f"overworld run {config.run_id}: workdir {work}", flush=True)
    security = RunSecurity.create(work, config.run_id) if secure else None
    # This process talks to the services as the operator (`overworld status` can, with --tls-dir).
    tls.use(security.identities["operator"] if security else None)
    print(f"  mutual TLS: certificates in {work / 'tls'}; `overworld status --tls-dir "
          f"{work / 'tls' / 'operator'}`" if security else "  --insecure: plaintext gRPC, no authorization",
          flush=True)
    supervisor = Supervisor(config, work, work / "config.yaml", security)
    follower = RunFollower(config, supervisor, work, Budget(max_env_steps, config.train_config.num_iterations,
                                                            target_return, keep_going), bool(resume),
                           progress_interval)
    stop_on_signals()
    status, error = "failed", None
    try:
        supervisor.start_all(resume)
        status = follower.follow()
    except KeyboardInterrupt:
        status = "interrupted"
        follower.buffer = follower.buffer_stats()  # the buffer's counters, read before it stops, as at an end
    except RuntimeError as err:  # ServiceFailed: a service refused its config, or crashed too often
        error = str(err)
        follower.display.message(f"error: {err}", sys.stderr)
    finally:
        follower.display.message("interrupted: stopping services..." if status == "interrupted" else "stopping services...")
        supervisor.stop(after_training=follower.read_final_counts,
                        before_trainer=follower.train_on_what_is_left if status != "interrupted" else None)
        tls.reset()
    summary = follower.summary(status, error)
    write_run_status(work, {**follower.status_record(status), "summary": summary_path})
    if summary_path:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_path).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("status", "env_steps", "episodes", "mean_return_last_100",
                                              "model_version", "updates", "wall_seconds")}), flush=True)
    return summary
