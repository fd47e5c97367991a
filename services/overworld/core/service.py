"""Running one service as a process: flags from the environment, metrics, logs, SIGTERM."""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

from prometheus_client import start_http_server

from overworld.core.config_files import ConfigError
from overworld.core.imports import UserCodeError


class Stoppable(Protocol):
    def stop(self, grace: float = 5.0) -> None: ...


def env_default(flag: str, default: object) -> object:
    """Default for --some-flag: $OVERWORLD_SOME_FLAG when set (the names the Helm chart uses)."""
    value = os.environ.get("OVERWORLD_" + flag.upper().replace("-", "_"))
    if value is None:
        return default
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(service: str) -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("OVERWORLD_LOG_FORMAT", "json") == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s"))
    logging.basicConfig(level=os.environ.get("OVERWORLD_LOG_LEVEL", "INFO").upper(), handlers=[handler], force=True)
    return logging.getLogger(f"overworld.{service}")


PARENT_PID_ENV = "OVERWORLD_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def stop_with_parent() -> None:
    """When $OVERWORLD_PARENT_PID is set (`overworld run` sets it for its services), ask Linux for a
    SIGTERM once that parent dies, even by SIGKILL: the services it started stop gracefully instead
    of running on as orphans (holding ports, GPUs and Ray). A no-op elsewhere."""
    parent = os.environ.pop(PARENT_PID_ENV, None)  # for this process only, not for what it starts
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logging.getLogger("overworld").warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return
    if os.getppid() != int(parent):  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


# Exit status of a service that cannot run as configured (sysexits' EX_CONFIG): starting it again
# would fail the same way, so `overworld run` does not restart it.
EXIT_CONFIG = 78

# The first words of the one record a service logs before it exits EXIT_CONFIG because of the user's
# code: `overworld run` shows the user that record (overworld/launch/service_logs.py).
REFUSAL_RECORD = "cannot run as configured"


def log_refusal(log: logging.Logger, err: UserCodeError | ConfigError) -> None:
    """The user's error, once: a config's, as its message (it names the key); a generator's, which
    generator and the user's own traceback (from the generator's frame down; its message is said only
    on the traceback's last line)."""
    cause = err.__cause__
    if not isinstance(err, UserCodeError) or cause is None:
        log.error("%s (exit code %d, not restarted): %s", REFUSAL_RECORD, EXIT_CONFIG, err)
        return
    below_call = cause.__traceback__.tb_next if cause.__traceback__ else None  # not Overworld's calling frame
    log.error("%s (exit code %d, not restarted): %s raised %s\n%s", REFUSAL_RECORD, EXIT_CONFIG, err.generator,
              type(cause).__name__, "".join(traceback.format_exception(type(cause), cause, below_call)).rstrip())


# A service that takes longer than this to stop writes every thread's stack to its log.
STOP_STACKS_AFTER_SECONDS = 30.0


def run_until_signalled(service: str, start: Callable[[], Stoppable], metrics_port: int,
                        done: threading.Event | None = None) -> int:
    """Start the service, serve /metrics, and block until SIGTERM/SIGINT (or `done` is set). EXIT_CONFIG
    when starting it raised the user's error (UserCodeError, or a run config it cannot use)."""
    log = setup_logging(service)
    stop_requested = done or threading.Event()

    signalled: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Not stop_requested.set(): the handler may run inside that event's wait on this very thread,
        # holding the lock set() takes. The loop below sees the flag.
        log.info("received %s, shutting down", signal.Signals(signum).name)
        signalled.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop_with_parent()
    if metrics_port:
        start_http_server(metrics_port)
    try:
        handle = start()
    except (UserCodeError, ConfigError) as err:
        log_refusal(log, err)
        return EXIT_CONFIG
    log.info("%s started (pid %d)", service, os.getpid())
    # Python runs signal handlers on the main thread, when it runs Python: a wait without a timeout
    # never sees a signal the kernel handed to another thread (a gRPC thread, say).
    while not signalled and not stop_requested.wait(1.0):
        pass
    stop_requested.set()
    started = time.monotonic()
    # A stop that hangs says where: every thread's stack goes to stderr (the service's log).
    faulthandler.dump_traceback_later(STOP_STACKS_AFTER_SECONDS, exit=False)
    handle.stop(10.0)
    faulthandler.cancel_dump_traceback_later()
    log.info("%s stopped cleanly in %.1fs", service, time.monotonic() - started)
    return 0
