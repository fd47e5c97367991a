"""The rollout side of overworld.online (MineStudio's RolloutManager actor): model-registry, gae,
rollout-manager, replay-buffer and the rollout workers, kept running by one supervisor process.

`python -m overworld.online.rollout_side WORKDIR` starts them from `WORKDIR/config.yaml`, writes
`WORKDIR/online.json` (its pid, the services' addresses, the run id and the config key that decides
whether a later start_rolloutmanager may reuse it), restarts any service that exits as `overworld
run` does, and stops everything on SIGTERM. Detached (`detach_rollout_manager: true`) it outlives the
script that started it; otherwise it stops when that script's process ends (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from overworld.core.config import RunConfig, as_dict, load_config
from overworld.core.service import stop_with_parent

STATE_FILE = "online.json"
TRAINER_FILE = "online-trainer.json"
IN_SERVICE_ENV = "OVERWORLD_ONLINE_SERVICE"  # set in every process the online API starts


def rollout_key(config: RunConfig) -> dict[str, Any]:
    """What the rollout side is built from: MineStudio restarts its RolloutManager when these change
    (the generators, rollout_config, and train_config's resume, discount and use_normalized_vf)."""
    d = as_dict(config)
    t = d.pop("train_config")
    for key in ("run_id", "logger_config", "trainer_name", "detach_rollout_manager"):
        d.pop(key)
    d["train_config"] = {k: t[k] for k in ("resume", "discount", "use_normalized_vf")}
    return d


def process_start_time(pid: int) -> str | None:
    """When the process `pid` started (clock ticks since boot); None if there is none, or only its
    exit status is left (a zombie: a process that exited and its parent has not reaped yet)."""
    from overworld.launch.processes import proc_stat  # one place parses /proc/<pid>/stat

    fields = proc_stat(pid)
    return None if fields is None or len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def alive(record: dict[str, Any] | None) -> bool:
    """The process a state record names is still that process (not a reused pid)."""
    if not record:
        return False
    return process_start_time(int(record["pid"])) == record.get("pid_started")


def read_state(workdir: Path, name: str = STATE_FILE) -> dict[str, Any] | None:
    try:
        return json.loads((workdir / name).read_text())
    except (OSError, ValueError):
        return None


def write_state(workdir: Path, record: dict[str, Any], name: str = STATE_FILE) -> None:
    tmp = workdir / f".{name}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(workdir / name)


def main(argv: list[str]) -> int:
    from overworld.core.security import tls
    from overworld.launch.credentials import RunSecurity
    from overworld.launch.supervisor import Supervisor

    workdir = Path(argv[0]).resolve()
    stop_with_parent()
    os.environ[IN_SERVICE_ENV] = "1"
    config = load_config(workdir / "config.yaml")
    # Mutual TLS as `overworld run`: the run's certificates in <workdir>/tls, which start_trainer reuses.
    security = RunSecurity.create(workdir, config.run_id)
    tls.use(security.identities["operator"])
    launcher = Supervisor(config, workdir, workdir / "config.yaml", security)
    stopping = [False]

    def on_signal(signum: int, _frame: object) -> None:
        stopping[0] = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    me = {"pid": os.getpid(), "pid_started": process_start_time(os.getpid()), "run_id": config.run_id,
          "key": rollout_key(config), "detached": config.detach_rollout_manager}
    code = 0
    try:
        write_state(workdir, {**me, "ready": False})
        launcher.start_rollout_side()
        write_state(workdir, {**me, "ready": True, "addresses": launcher.addresses})
        while not stopping[0]:
            time.sleep(0.5)
            launcher.supervise()  # any service that exits, as `overworld run` restarts them (RuntimeError at the limit)
            launcher.remember_families()
    except Exception as err:  # noqa: BLE001 - reported through the state file and the log
        print(f"error: {err}", flush=True)
        write_state(workdir, {**me, "ready": False, "error": str(err)[:2000]})
        code = 1
    finally:
        launcher.stop()
        state = read_state(workdir)
        if state and state.get("pid") == os.getpid() and "error" not in state:
            with contextlib.suppress(FileNotFoundError):
                (workdir / STATE_FILE).unlink()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
