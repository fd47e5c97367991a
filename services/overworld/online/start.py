"""MineStudio's entry points with MineStudio's signatures, running Overworld's services.

    from overworld.online import start_rolloutmanager, start_trainer
    start_rolloutmanager(policy_generator, env_generator, online_cfg)
    start_trainer(policy_generator, env_generator, online_cfg)

`start_rolloutmanager` starts the rollout side (model-registry, gae, rollout-manager, replay-buffer,
rollout workers; see rollout_side.py) as processes on loopback, or reuses the running one when its
config is unchanged, as MineStudio reuses its named RolloutManager actor. `start_trainer` runs the
trainer service until training ends, as MineStudio's `trainer.fit()` blocks. Both return at once
inside a process the online API started itself: a service that imports the user's script to find
its generators must not start another run (put long-running code under `if __name__ == "__main__":`).

Everything lives in one work directory: `workdir=`, else $OVERWORLD_WORKDIR, else `runs/online`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from overworld.core.config import RunConfig, load_config, to_yaml
from overworld.core.service import PARENT_PID_ENV
from overworld.online.generators import GeneratorError, generator_ref
from overworld.online.rollout_side import (
    IN_SERVICE_ENV,
    STATE_FILE,
    TRAINER_FILE,
    alive,
    process_start_time,
    read_state,
    rollout_key,
    write_state,
)

log = logging.getLogger("overworld.online")

READY_TIMEOUT_SECONDS = 600.0  # building envs and policies (a Minecraft) before the services answer
STOP_TIMEOUT_SECONDS = 200.0


def _in_service() -> bool:
    if os.environ.get(IN_SERVICE_ENV):
        return True
    if not logging.getLogger().handlers and not log.handlers:  # a plain script: show what we do
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    return False


def _workdir(workdir: str | os.PathLike | None) -> Path:
    path = Path(workdir or os.environ.get("OVERWORLD_WORKDIR") or "runs/online").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _service_env(parent_pid: int | None = None) -> dict[str, str]:
    """The environment of the processes the online API starts: the caller's import path (its script's
    directory included, so modules it imported by name are found), and the in-service marker."""
    paths = [p for p in (str(Path(sys.argv[0]).resolve().parent) if sys.argv and sys.argv[0] else "",
                         os.getcwd(), os.environ.get("PYTHONPATH", "")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), IN_SERVICE_ENV: "1", "PYTHONUNBUFFERED": "1"}
    env.pop(PARENT_PID_ENV, None)
    if parent_pid is not None:
        env[PARENT_PID_ENV] = str(parent_pid)
    return env


def online_config(policy_generator: Any, env_generator: Any, online_cfg: Mapping[str, Any] | DictConfig) -> RunConfig:
    """MineStudio's (policy_generator, env_generator, online_cfg) as a validated RunConfig."""
    data: dict[str, Any]
    if isinstance(online_cfg, DictConfig):
        data = cast(dict[str, Any], OmegaConf.to_container(online_cfg, resolve=True))  # a DictConfig's is a dict
    else:
        data = dict(online_cfg)
    assert isinstance(data, dict)
    data["policy_generator"] = generator_ref(policy_generator, "policy_generator")
    data["env_generator"] = generator_ref(env_generator, "env_generator")
    data["trainer_name"] = _trainer_ref(str(data.get("trainer_name", "PPOTrainer")), policy_generator)
    return load_config(data)


def _trainer_ref(name: str, policy_generator: Any) -> str:
    """A trainer class named as MineStudio names it: Overworld's own, or a class of that name next to
    the generators (a subclass in the user's quick start file)."""
    from overworld.trainer.driver import TRAINERS

    if ":" in name or name in TRAINERS or not callable(policy_generator):
        return name
    module = sys.modules.get(getattr(policy_generator, "__module__", ""))
    cls = getattr(module, name, None)
    return generator_ref(cls, "trainer_name") if isinstance(cls, type) else name


def _wait(proc: subprocess.Popen, ready: Callable[[], dict[str, Any] | None], what: str, log_path: Path,
          timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = ready()
        if state is not None:
            return state
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:]) if log_path.exists() else ""
    raise RuntimeError(f"{what} did not start (see {log_path}):\n{tail}")


def _stop_process(record: dict[str, Any], timeout: float = STOP_TIMEOUT_SECONDS) -> None:
    if not alive(record):
        return
    pid = int(record["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(record) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(record):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):  # this script's own child (non-detached): collect its exit
        os.waitpid(pid, os.WNOHANG)


def start_rolloutmanager(policy_generator: Any, env_generator: Any, online_cfg: Mapping[str, Any] | DictConfig,
                         address: str | None = None, *, workdir: str | os.PathLike | None = None) -> dict[str, str]:
    """Start (or reuse) the rollout side; returns the services' addresses.

    `address` is MineStudio's Ray address: there is no Ray cluster on the rollout side here (each
    service is its own process), so it is not used."""
    if _in_service():
        return {}
    if address not in (None, "localhost:9899", "auto"):
        log.warning("start_rolloutmanager(address=%r): the rollout side runs as local processes, not on a Ray "
                    "cluster; the address is not used", address)
    config = online_config(policy_generator, env_generator, online_cfg)
    work = _workdir(workdir)
    state = read_state(work)
    if alive(state):
        assert state is not None
        if state.get("key") == rollout_key(config) and state.get("ready"):
            log.info("Reusing existing rollout manager (run %s, %s)", state["run_id"], work)
            _stop_with_script(state, config)
            return state["addresses"]
        log.warning("Rollout manager config changed, killing and restarting rollout manager")
        _stop_process(state)
    config.run_id = config.run_id or f"online-{time.strftime('%Y%m%d-%H%M%S')}"
    (work / "config.yaml").write_text(to_yaml(config))
    (work / STATE_FILE).unlink(missing_ok=True)
    log_path = work / "logs" / "rollout-side.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    detached = config.detach_rollout_manager
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "overworld.online.rollout_side", str(work)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=_service_env(None if detached else os.getpid()))

    def ready() -> dict[str, Any] | None:
        s = read_state(work)
        if s and s.get("error"):
            raise RuntimeError(f"the rollout side failed: {s['error']} (see {log_path})")
        return s if s and s.get("ready") and s.get("pid") == proc.pid else None

    try:
        state = _wait(proc, ready, "the rollout side", log_path, READY_TIMEOUT_SECONDS)
    except BaseException:
        proc.terminate()  # it stops what it started
        proc.wait(STOP_TIMEOUT_SECONDS)
        raise
    _stop_with_script(state, config)
    log.info("rollout side of run %s started in %s: %s", config.run_id, work, state["addresses"])
    return state["addresses"]


def _stop_with_script(state: dict[str, Any], config: RunConfig) -> None:
    """detach_rollout_manager false: the rollout side ends with this script (MineStudio's non-detached
    actor dies with its driver)."""
    if not config.detach_rollout_manager:
        atexit.register(_stop_process, dict(state))


def stop_rolloutmanager(workdir: str | os.PathLike | None = None) -> bool:
    """Stop a (detached) rollout side; MineStudio users would `ray stop`. True if one was running."""
    work = _workdir(workdir)
    state = read_state(work)
    if not alive(state):
        return False
    assert state is not None
    _stop_process(state)
    return True


def start_trainer(policy_generator: Any, env_generator: Any, online_cfg: Mapping[str, Any] | DictConfig,
                  whole_config: str | None = None, *, workdir: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Run the trainer (trainer_name, train_config) against the running rollout side until training
    ends; returns the trainer's last status. As MineStudio: "Trainer already running!" and return if a
    trainer of this work directory runs. `whole_config` (MineStudio saves it with checkpoints) is
    kept as `whole_config.py` in the work directory."""
    if _in_service():
        return None
    from overworld.core.security import tls
    from overworld.launch.credentials import RunSecurity
    from overworld.launch.supervisor import Supervisor
    from overworld.trainer.client import TrainerClient

    work = _workdir(workdir)
    side = read_state(work)
    if not alive(side) or not side or not side.get("ready"):
        raise RuntimeError(f"no rollout side is running in {work}: call start_rolloutmanager(policy_generator, "
                           "env_generator, online_cfg) first")
    running = read_state(work, TRAINER_FILE)
    if alive(running):
        print("Trainer already running!")
        return None
    config = online_config(policy_generator, env_generator, online_cfg)
    config.run_id = side["run_id"]
    trainer_yaml = work / "trainer-config.yaml"
    trainer_yaml.write_text(to_yaml(config))
    if whole_config is not None:
        (work / "whole_config.py").write_text(whole_config)
    security = RunSecurity.load(work)  # the rollout side's certificates: the trainer joins its run
    tls.use(security.identities["operator"] if security else None)
    launcher = Supervisor(config, work, work / "config.yaml", security)
    launcher.addresses.update(side["addresses"])
    launcher.extra_env = {k: v for k, v in _service_env().items() if k in ("PYTHONPATH", IN_SERVICE_ENV)}
    launcher.services_file = "services-trainer.json"  # the rollout side's launcher writes services.json
    child = launcher.start_trainer(None, "--config", str(trainer_yaml))
    write_state(work, {"pid": child.proc.pid, "pid_started": process_start_time(child.proc.pid)}, TRAINER_FILE)
    trainer = TrainerClient(child.address)
    status: Any = None
    try:
        while True:
            time.sleep(1.0)
            launcher.remember_families()  # Ray's processes, to be stopped with the trainer
            if launcher.dead():
                if status is not None and status.state == "finished":
                    break
                launcher.supervise()  # restarted as `overworld run` restarts it (RuntimeError at the limit)
                restarted = next(c for c in launcher.children if c.name == "trainer")
                if restarted is not child:
                    child = restarted
                    trainer = TrainerClient(child.address)
                    write_state(work, {"pid": child.proc.pid, "pid_started": process_start_time(child.proc.pid)},
                                TRAINER_FILE)
                continue
            try:
                status = trainer.status(timeout=5)
            except Exception:  # noqa: BLE001 - not serving yet
                continue
            if status.state == "finished":
                child.proc.wait(STOP_TIMEOUT_SECONDS)
                break
    finally:
        launcher.stop()
        tls.reset()
        (work / TRAINER_FILE).unlink(missing_ok=True)
    return {"state": status.state if status else "unknown", "iteration": status.iteration if status else 0,
            "model_version": status.model_version if status else 0, "updates": status.updates if status else 0,
            "latest_checkpoint": status.latest_checkpoint if status else "", "workdir": str(work)}


__all__ = ["GeneratorError", "start_rolloutmanager", "start_trainer", "stop_rolloutmanager"]
