"""Where the rollout-manager keeps its state so that a restart takes up where it was: named JSON parts
(`run`: run id, spaces, counters of departed workers, the last episode report applied per worker;
`episodes`: the episode statistics; `worker:ID`: one per worker with its cumulative counters), in
Redis on a cluster or in a file beside the run on one machine. A heartbeat rewrites only its worker's
part, so saving every change stays cheap with a large fleet.

- Redis (`--index redis://HOST:PORT/DB`, the replay-buffer's index): one hash, `ow:rm:{RUN}:state`,
  a field per part; the parts of one save are written in one transaction.
- A file (the embedded index, `memory`): `<workdir>/rollout-manager/<RUN>.json`, rewritten aside and
  renamed, so a process killed mid-write leaves the previous version.

RUN is the config's run_id (or, without one, the config hash: the same config finds its state again).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, cast

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class StateUnavailable(RuntimeError):
    """The state store cannot be reached (Redis down, disk full): nothing was saved."""


class StateStore(Protocol):
    where: str

    def load(self) -> dict[str, Any]: ...
    def save(self, parts: dict[str, Any], gone: Iterable[str] = ()) -> None: ...
    def clear(self) -> None: ...


class FileState:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self._parts: dict[str, Any] = {}

    def load(self) -> dict[str, Any]:
        try:
            self._parts = json.loads(self.path.read_text())
        except FileNotFoundError:
            self._parts = {}
        except (OSError, ValueError) as err:
            raise StateUnavailable(f"cannot read {self.path}: {err}") from err
        return dict(self._parts)

    def save(self, parts: dict[str, Any], gone: Iterable[str] = ()) -> None:
        updated = {**self._parts, **parts}
        for name in gone:
            updated.pop(name, None)
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(updated))
            os.replace(tmp, self.path)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise StateUnavailable(f"cannot write {self.path}: {err}") from err
        self._parts = updated

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
        self._parts = {}


class RedisState:
    def __init__(self, url: str, key: str, password: str | None = None) -> None:
        import redis

        self._errors = (redis.ConnectionError, redis.TimeoutError)
        extra = {"password": password} if password else {}  # wins over one in the URL, as the index's
        self.client = redis.Redis.from_url(url, **extra, socket_timeout=5, socket_connect_timeout=2)
        self.key = key
        self.where = f"{url} (hash {key})"

    def load(self) -> dict[str, Any]:
        try:
            # no decode_responses: names and values come as bytes
            raw = cast(dict[bytes, bytes], self.client.hgetall(self.key))
        except self._errors as err:
            raise StateUnavailable(f"Redis {self.where}: {err}") from err
        return {name.decode(): json.loads(value) for name, value in raw.items()}

    def save(self, parts: dict[str, Any], gone: Iterable[str] = ()) -> None:
        gone = list(gone)
        try:
            with self.client.pipeline(transaction=True) as pipe:
                if parts:
                    pipe.hset(self.key, mapping={name: json.dumps(value) for name, value in parts.items()})
                if gone:
                    pipe.hdel(self.key, *gone)
                pipe.execute()
        except self._errors as err:
            raise StateUnavailable(f"Redis {self.where}: {err}") from err

    def clear(self) -> None:
        try:
            self.client.delete(self.key)
        except self._errors as err:
            raise StateUnavailable(f"Redis {self.where}: {err}") from err


def open_state_store(index_url: str, workdir: str, run: str, password: str | None = None) -> StateStore:
    """Redis when the run's index is Redis (`password`: $OVERWORLD_REDIS_PASSWORD), else a file under
    the workdir."""
    name = _UNSAFE.sub("_", run)[:64] or "run"
    if index_url.startswith(("redis://", "rediss://", "unix://")):
        return RedisState(index_url, f"ow:rm:{{{name}}}:state", password)
    return FileState(Path(workdir) / "rollout-manager" / f"{name}.json")
