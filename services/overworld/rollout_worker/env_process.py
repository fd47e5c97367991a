"""The main of one env process (spawned by env_pool.EnvPool). It imports numpy and the env
generator only: never torch, never gRPC.

Parent -> process: b"s" + group byte (step that group's slots marked in `act`), b"c" (close).
Process -> parent, JSON: {"hello": pid} once; one reply per step command ({"group", "stepped",
"ended", "errors", "recycled", "joined"}); unsolicited {"joined": [...]} when a background reset
finished; {"fatal": msg} before exiting when an env cannot be rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from overworld.core.specs import TensorSpec
from overworld.rollout_worker.env_runner import EnvRunner
from overworld.rollout_worker.shm import SharedArrays

STEP, CLOSE = b"s", b"c"


def _send(conn: Connection, lock: threading.Lock, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    with lock:
        conn.send_bytes(data)


def main(conn: Connection, env_ref: str, env_kwargs: dict[str, Any], slots: list[int], groups: dict[int, list[int]],
         seeds: dict[int, int], spec: dict[str, TensorSpec], num_envs: int, shm_names: dict[str, str],
         restart_interval: float | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.setswitchinterval(0.001)  # the reset thread must hand the GIL back quickly to the stepping loop
    logging.basicConfig(level=os.environ.get("OVERWORLD_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format=f"%(asctime)s env-process[{os.getpid()}] %(levelname)s %(message)s")
    from overworld.core.imports import call_generator, import_object
    from overworld.envs.minestudio import adapt_env

    shared = SharedArrays(spec, num_envs, shm_names)
    lock = threading.Lock()
    generator = import_object(env_ref)

    # A background join must not overtake the reply that reports the end of the slot's episode:
    # while a step is in progress, joins wait and ride on that step's reply.
    stepping = [False]
    held: list[int] = []

    def announce(joined: list[int]) -> None:
        with lock:
            if stepping[0] and not runner.fatal:
                held.extend(joined)
                return
            message: dict[str, Any] = {"joined": joined}
            if runner.fatal:
                message["fatal"] = runner.fatal
            conn.send_bytes(json.dumps(message).encode())

    runner = EnvRunner(lambda: adapt_env(call_generator(generator, dict(env_kwargs))), slots, seeds, shared.arrays,
                       restart_interval, background=True, announce=announce)
    _send(conn, lock, {"hello": os.getpid()})
    runner.start()
    try:
        while True:
            try:
                cmd = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the worker is gone
            if cmd[:1] == CLOSE:
                break
            group = cmd[1]
            with lock:
                stepping[0] = True
            reply: dict[str, Any] = {"group": group, **runner.step(groups[group])}
            with lock:
                stepping[0] = False
                reply["joined"] = reply["joined"] + held
                held.clear()
                if runner.fatal:
                    reply["fatal"] = runner.fatal
                conn.send_bytes(json.dumps(reply).encode())
            if runner.fatal:
                break
    finally:
        runner.close()
        shared.close(unlink=False)
