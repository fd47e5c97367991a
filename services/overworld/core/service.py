"""Running one service as a process: flags from the environment, metrics, logs, SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import start_http_server


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


def run_until_signalled(service: str, start: Callable[[], Stoppable], metrics_port: int,
                        done: threading.Event | None = None) -> int:
    """Start the service, serve /metrics, and block until SIGTERM/SIGINT (or `done` is set)."""
    log = setup_logging(service)
    stop_requested = done or threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if metrics_port:
        start_http_server(metrics_port)
    handle = start()
    log.info("%s started (pid %d)", service, os.getpid())
    while not stop_requested.wait(0.5):
        pass
    started = time.monotonic()
    handle.stop(10.0)
    log.info("%s stopped cleanly in %.1fs", service, time.monotonic() - started)
    return 0
