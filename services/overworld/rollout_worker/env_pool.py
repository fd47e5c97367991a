"""Environments in subprocesses, stepped in lockstep, with observations in shared memory.

Per step the parent writes actions into shared memory and sends each process one byte; each
process steps its environments, resets the finished ones (writing the final observation of a
truncated episode aside, for bootstrapping), and answers with a short JSON line of episode ends.
No observation or action is ever pickled.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from overworld.core.specs import Spaces, TensorSpec

STEP, RESET, CLOSE = b"s", b"r", b"c"


@dataclass
class StepResult:
    obs: dict[str, np.ndarray]  # after the step (reset observation where the episode ended)
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_obs: dict[str, np.ndarray]  # final observation where truncated (else stale)
    episode_infos: dict[int, dict[str, float]]  # slot -> extras of the episode that ended


def _layout(spaces: Spaces) -> dict[str, TensorSpec]:
    out = {}
    for k, s in spaces.obs.items():
        out[f"obs.{k}"] = s
        out[f"final_obs.{k}"] = s
    for k, s in spaces.action.items():
        out[f"action.{k}"] = s
    out["reward"] = TensorSpec((), "float32")
    out["terminated"] = TensorSpec((), "bool")
    out["truncated"] = TensorSpec((), "bool")
    return out


class SharedArrays:
    def __init__(self, layout: dict[str, TensorSpec], num_envs: int, names: dict[str, str] | None = None) -> None:
        self.blocks: dict[str, shared_memory.SharedMemory] = {}
        self.arrays: dict[str, np.ndarray] = {}
        for key, spec in layout.items():
            shape = (num_envs, *spec.shape)
            nbytes = max(1, int(np.prod(shape)) * np.dtype(spec.dtype).itemsize)
            if names is None:
                block = shared_memory.SharedMemory(create=True, size=nbytes)
            else:
                block = shared_memory.SharedMemory(name=names[key])
            self.blocks[key] = block
            self.arrays[key] = np.ndarray(shape, dtype=spec.dtype, buffer=block.buf)

    @property
    def names(self) -> dict[str, str]:
        return {k: b.name for k, b in self.blocks.items()}

    def close(self, unlink: bool) -> None:
        self.arrays.clear()
        for block in self.blocks.values():
            block.close()
            if unlink:
                block.unlink()


def _to_dict_obs(obs: Any, keys: list[str]) -> dict[str, Any]:
    return obs if isinstance(obs, dict) else {keys[0]: obs}


def _env_process(conn: Any, env_ref: str, env_kwargs: dict[str, Any], slots: list[int], seeds: list[int],
                 layout: dict[str, TensorSpec], num_envs: int, shm_names: dict[str, str]) -> None:
    from overworld.core.imports import call_generator, import_object

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shared = SharedArrays(layout, num_envs, shm_names)
    a = shared.arrays
    obs_keys = sorted(k[4:] for k in layout if k.startswith("obs."))
    action_keys = sorted(k[7:] for k in layout if k.startswith("action."))
    generator = import_object(env_ref)
    envs = [call_generator(generator, env_kwargs) for _ in slots]

    def write_obs(prefix: str, slot: int, obs: Any) -> None:
        for k, v in _to_dict_obs(obs, obs_keys).items():
            a[f"{prefix}.{k}"][slot] = v

    try:
        while True:
            cmd = conn.recv_bytes()
            if cmd == CLOSE:
                break
            ended: dict[int, dict[str, float]] = {}
            for env, slot, seed in zip(envs, slots, seeds, strict=True):
                if cmd == RESET:
                    obs, _ = env.reset(seed=seed)
                    write_obs("obs", slot, obs)
                    continue
                if len(action_keys) == 1 and action_keys[0] == "action":
                    action: Any = a["action.action"][slot].item() if a["action.action"][slot].ndim == 0 \
                        else a["action.action"][slot].copy()
                else:
                    action = {k: a[f"action.{k}"][slot].copy() for k in action_keys}
                obs, reward, terminated, truncated, info = env.step(action)
                a["reward"][slot] = reward
                a["terminated"][slot] = terminated
                a["truncated"][slot] = truncated and not terminated
                if terminated or truncated:
                    if truncated and not terminated:
                        write_obs("final_obs", slot, obs)
                    extras = info.get("achievements", {}) if isinstance(info, dict) else {}
                    ended[slot] = {k: float(v) for k, v in extras.items()}
                    obs, _ = env.reset()
                write_obs("obs", slot, obs)
            conn.send_bytes(json.dumps(ended).encode())
    finally:
        for env in envs:
            env.close()
        shared.close(unlink=False)


class EnvPool:
    def __init__(self, env_ref: str, env_kwargs: dict[str, Any], spaces: Spaces, num_envs: int,
                 num_processes: int, seed: int) -> None:
        self.num_envs = num_envs
        self.spaces = spaces
        layout = _layout(spaces)
        self.shared = SharedArrays(layout, num_envs)
        ctx = mp.get_context("spawn")
        num_processes = max(1, min(num_processes or num_envs, num_envs))
        groups = np.array_split(np.arange(num_envs), num_processes)
        self.conns = []
        self.procs = []
        for group in groups:
            parent, child = ctx.Pipe()
            slots = [int(i) for i in group]
            proc = ctx.Process(target=_env_process, daemon=True, args=(
                child, env_ref, env_kwargs, slots, [seed + i for i in slots], layout, num_envs, self.shared.names))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def _broadcast(self, cmd: bytes) -> dict[int, dict[str, float]]:
        for conn in self.conns:
            conn.send_bytes(cmd)
        ended: dict[int, dict[str, float]] = {}
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if not conn.poll(600):
                raise TimeoutError(f"environment process {proc.pid} did not answer in 600s")
            ended.update({int(k): v for k, v in json.loads(conn.recv_bytes()).items()})
        return ended

    def _view(self, prefix: str) -> dict[str, np.ndarray]:
        return {k: self.shared.arrays[f"{prefix}.{k}"] for k in self.spaces.obs}

    def reset(self) -> dict[str, np.ndarray]:
        self._broadcast(RESET)
        return self._view("obs")

    def step(self, action: dict[str, np.ndarray]) -> StepResult:
        for k, v in action.items():
            self.shared.arrays[f"action.{k}"][:] = v
        ended = self._broadcast(STEP)
        a = self.shared.arrays
        return StepResult(self._view("obs"), a["reward"], a["terminated"], a["truncated"],
                          self._view("final_obs"), ended)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(CLOSE)
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(1)
        self.shared.close(unlink=True)
