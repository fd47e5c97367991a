"""The replay index in Redis: MemoryIndex's semantics, made atomic across any number of fronts.

Every state change (add, claim, version move, orphan claim, reset) is one Lua script, so it runs as
one atomic step however many fronts and trainer readers call it at once; the rate limiter's state
(chunks inserted, chunks sampled, credit) lives in the same hash and is read and written inside the
same scripts. Reads of statistics are one script too (a consistent snapshot).

Keys, all under `ow:rb:{RUN_ID}:` (a hash tag: one cluster slot per run; a new run never sees
another run's keys):
  meta     hash   version, next_chunk, inserted, sampled, reuse_sum, reuse_count, frags, bytes,
                  vsum (sum of held chunks' first model versions), li/ls/lc (limiter inserts,
                  samples, credit), lr (fragments reserved, all holders), rx (reserved fragments
                  whose holder went quiet), attempt (the last reset token), refs_at (Redis time of
                  the last claim by reference)
  drops    hash   reason -> chunks dropped
  fifo     zset   chunk id scored by chunk id (insertion order: eviction takes the lowest)
  byver    zset   chunk id scored by its first model version (staleness drops take a range; claims in
                  the "oldest" order take the first; ids are zero-padded, so ties go by arrival)
  chunk:ID hash   t (times sampled), v, b (bytes), n (fragments), s (slot), k (blob keys, one per
                  line), m ("sequence|version|bytes" per line)
  slots    hash   env slot -> last sequence number seen (duplicates are acknowledged, not re-added)
  partial  hash   env slot -> fragments of the chunk being assembled ("seq|version|bytes|key" lines)
  live     set    every blob key the index references (the orphan sweeper spares these)
  swept    zset   blob keys the sweeper claimed, scored by time (add refuses them)
  resv     hash   holder (worker id) -> "fragments|ttl" of room it reserved and has not used
  resvx    zset   holder scored by the Redis time its reservation lapses
  want     hash   holder -> "fragments|until": room it waits for to go on with episodes it began (asks
                  that would begin an episode get room only beyond the other holders' wants)
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from overworld.replay_buffer.index import (
    BLOCKED,
    DUPLICATE,
    OK,
    SAMPLE_ORDERS,
    SWEPT,
    SWEPT_RETENTION_SECONDS,
    AddResult,
    Chunk,
    Claim,
    FragmentMeta,
    IndexStats,
    IndexUnavailable,
    VersionMove,
)
from overworld.replay_buffer.rate_limiter import RateLimiter
from overworld.replay_buffer.redis_scripts import (
    ADD,
    CLAIM,
    CLAIM_ORPHANS,
    FORGET_HOLDERS,
    REF_CLAIM_AGE,
    RESERVE,
    RESET,
    SET_VERSION,
    STATS,
    UNREFERENCED,
)
from overworld.replay_buffer.room import DEMAND_SECONDS

T = TypeVar("T")

def key_prefix(run_id: str) -> str:
    if not run_id:
        raise ValueError("the Redis index needs a run_id (the key prefix that isolates runs)")
    return f"ow:rb:{{{run_id}}}:"


class RedisIndex:
    def __init__(self, client: redis.Redis, run_id: str, max_chunks: int, max_reuse: int, max_staleness: int,
                 fragments_per_chunk: int, rate_limiter: RateLimiter | None = None,
                 seed: int | None = None, sample_order: str = "oldest") -> None:
        if sample_order not in SAMPLE_ORDERS:
            raise ValueError(f"sample_order must be one of {SAMPLE_ORDERS}, got {sample_order!r}")
        self.sample_order = sample_order
        self.client = client
        self.run_id = run_id
        self.prefix = key_prefix(run_id)
        self.max_chunks = max_chunks
        self.max_reuse = max_reuse
        self.max_staleness = max_staleness
        self.fragments_per_chunk = fragments_per_chunk
        self.limiter = rate_limiter
        self._rng = random.Random(seed)
        lim = rate_limiter
        self._base = [self.prefix, lim.samples_per_insert if lim else 0, lim.error if lim else 0,
                      lim.min_size if lim else 1]
        self._keys = [self.prefix + "meta"]
        self._add = client.register_script(ADD)
        self._reserve = client.register_script(RESERVE)
        self._forget_holders = client.register_script(FORGET_HOLDERS)
        self._claim = client.register_script(CLAIM)
        self._ref_claim_age = client.register_script(REF_CLAIM_AGE)
        self._set_version = client.register_script(SET_VERSION)
        self._stats = client.register_script(STATS)
        self._claim_orphans = client.register_script(CLAIM_ORPHANS)
        self._unreferenced = client.register_script(UNREFERENCED)
        self._reset = client.register_script(RESET)

    @classmethod
    def from_url(cls, url: str, run_id: str, rb: Any, limiter: RateLimiter | None = None,
                 seed: int | None = None, password: str | None = None) -> RedisIndex:
        """`rb` is a core.config.ReplayBufferConfig (max_chunks, max_reuse, max_staleness, fragments_per_chunk,
        sample_order).
        `password` (the chart's $OVERWORLD_REDIS_PASSWORD) wins over one in the URL."""
        extra = {"password": password} if password else {}
        client = redis.Redis.from_url(
            url, **extra, decode_responses=True, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3))
        return cls(client, run_id, rb.max_chunks, rb.max_reuse, rb.max_staleness, rb.fragments_per_chunk,
                   limiter, seed, rb.sample_order)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as err:  # BusyLoadingError is a ConnectionError
            raise IndexUnavailable(f"Redis index unavailable: {err}") from err

    def _run(self, script: Any, *args: Any) -> Any:
        return self._call(lambda: script(keys=self._keys, args=[*self._base, *args]))

    def add(self, meta: FragmentMeta) -> AddResult:
        out = self._run(self._add, meta.slot_key, meta.sequence, meta.first_model_version, meta.nbytes,
                        meta.blob_key, self.max_chunks, self.max_staleness, self.fragments_per_chunk, meta.holder)
        status = {"ok": OK, "duplicate": DUPLICATE, "blocked": BLOCKED, "swept": SWEPT}[out[0]]
        dropped = {r: int(c) for r, c in zip(("incomplete", "stale_on_arrival", "evicted"), out[2:5], strict=True) if int(c)}
        return AddResult(bool(int(out[1])), list(out[5:]), status, dropped)

    def _limiter_state(self, inserts: Any, samples: Any, credit: Any, reserved: Any) -> RateLimiter | None:
        if self.limiter is None:
            return None
        return dataclasses.replace(self.limiter, inserts=int(inserts or 0), samples=int(samples or 0),
                                   credit=float(credit or 0.0),
                                   reserved=int(reserved or 0) / self.fragments_per_chunk)

    def can_insert(self) -> bool:
        if self.limiter is None:
            return True
        state = self._call(lambda: self.client.hmget(self.prefix + "meta", "li", "ls", "lc", "lr"))
        limiter = self._limiter_state(*state)
        assert limiter is not None
        return limiter.can_insert()

    def reserve(self, holder: str, n: int, ttl: float, starting: int = 0, fleet: int = 1) -> int:
        if self.limiter is None:
            return n
        return int(self._run(self._reserve, holder, n, ttl, self.fragments_per_chunk, 0, starting, DEMAND_SECONDS,
                             fleet))

    def release(self, holder: str, n: int) -> None:
        if self.limiter is not None:
            self._run(self._reserve, holder, 0, 0, self.fragments_per_chunk, n, 0, DEMAND_SECONDS, 1)

    def holders(self) -> list[str]:
        keys: list[Any] = self._call(lambda: self.client.hkeys(self.prefix + "resv"))
        return sorted(str(k) for k in keys)  # decode_responses: already str

    def forget_holders(self, holders: list[str]) -> int:
        if not holders:
            return 0
        return int(self._run(self._forget_holders, *holders))

    def claim(self, n: int, by_ref: bool = False) -> list[Claim]:
        out = self._run(self._claim, n, self.max_reuse, self._rng.randrange(1 << 31), "1" if by_ref else "0",
                        self.sample_order)
        claims = []
        for i in range(0, len(out), 6):
            chunk_id, times, final, slot, keys, metas = out[i:i + 6]
            fragments = []
            for key, m in zip(keys.split("\n"), metas.split("\n"), strict=True):
                seq, ver, nbytes = m.split("|")
                fragments.append(FragmentMeta(slot, int(seq), int(ver), int(nbytes), key))
            claims.append(Claim(Chunk(int(chunk_id), fragments, int(times)), bool(int(final))))
        return claims

    def ref_claim_age(self) -> float | None:
        out = self._run(self._ref_claim_age)
        return None if out is None else max(0.0, float(out))

    def set_model_version(self, version: int) -> VersionMove:
        out = self._run(self._set_version, version, self.max_staleness)
        if out[0] == "back":
            raise ValueError(f"model version cannot go back from {out[1]} to {version}")
        return VersionMove(int(out[1]), list(out[2:]))

    def model_version(self) -> int:
        return int(self._call(lambda: self.client.hget(self.prefix + "meta", "version")) or 0)

    def _raw_stats(self) -> tuple[IndexStats, RateLimiter | None, int]:
        meta, drops, chunks, oldest, (reserved, expired) = self._run(self._stats)
        frags, nbytes, inserted, sampled, version, reuse_sum, reuse_count, vsum, li, ls, lc = (
            int(float(v)) if v is not None and i != 10 else v for i, v in enumerate(meta))
        version = version or 0
        chunks = int(chunks)
        dropped = {drops[i]: int(drops[i + 1]) for i in range(0, len(drops), 2)}
        stats = IndexStats(
            fragments=frags or 0, chunks=chunks, bytes=nbytes or 0, inserted_fragments=inserted or 0,
            sampled_chunks=sampled or 0, dropped=dropped, model_version=version,
            mean_reuse=(reuse_sum or 0) / reuse_count if reuse_count else 0.0,
            mean_staleness=version - (vsum or 0) / chunks if chunks else 0.0,
            max_staleness=max(0, version - int(float(oldest))) if oldest else 0,
            reserved_fragments=int(reserved or 0), expired_reservations=int(expired or 0))
        return stats, self._limiter_state(li, ls, lc, reserved), chunks

    def stats(self) -> IndexStats:
        return self._raw_stats()[0]

    def describe_wait(self) -> str:
        _, limiter, chunks = self._raw_stats()
        text = f"{chunks} chunks in the buffer"
        return f"{text}; {limiter.describe()}" if limiter else text

    def unreferenced(self, keys: list[str]) -> list[str]:
        out: list[str] = []
        for start in range(0, len(keys), 500):
            out += self._run(self._unreferenced, *keys[start:start + 500])
        return out

    def claim_orphans(self, keys: list[str]) -> list[str]:
        out: list[str] = []
        for start in range(0, len(keys), 500):
            out += self._run(self._claim_orphans, time.time(), SWEPT_RETENTION_SECONDS, *keys[start:start + 500])
        return out

    def reset(self, token: str | None = None) -> list[str] | None:
        out = self._run(self._reset, token or "", "1" if token is not None else "0")
        return None if int(out[0]) == 0 else list(out[1:])

    def close(self) -> None:
        self.client.close()
