"""The replay index: which fragments form which chunks, how often each chunk was sampled, and
what to drop. `MemoryIndex` is the embedded backend; `RedisIndex` (redis_index.py) keeps exactly the
same semantics in Redis, atomically across any number of fronts and readers.

Semantics (MineStudio's replay_buffer_config, made exact):
- `fragments_per_chunk` consecutive fragments (by sequence number) of one env slot form a chunk;
  a gap in the sequence discards the partial chunk ("incomplete").
- `max_chunks`: the oldest chunk is evicted when a new one would exceed it ("evicted").
- `max_reuse`: a chunk is removed once it has been sampled that many times ("reused").
- `sample_order`: "oldest" claims the chunks whose first step is oldest first (by model version, then
  arrival), so a chunk waits no longer than the chunks stepped before it and none is left to go stale;
  "uniform" (MineStudio's) claims uniformly at random.
- `max_staleness`: a chunk whose first step is older than model_version - max_staleness is dropped
  on arrival ("stale_on_arrival": stepped too slowly for the learner, or held in the worker's queue) and
  whenever the model version moves ("stale": it waited in the buffer too long).
- Delivery is at least once: a fragment whose sequence number is not above the last one seen for
  its env slot is a duplicate (a worker resending after a lost ack); it is acknowledged as stored
  and changes nothing.
- The rate limiter (if any) is checked inside `add`, `claim` and `reserve`, under the same lock or
  script as the state it guards, so several fronts can never overshoot it.
- Reservations: a worker (the holder: its worker id) reserves room for fragments before it steps them
  (`reserve`); its fragments then take that room without another check. A holder gives back what it
  will not use (`release`); the front gives back the room of a holder whose lease is gone
  (`forget_holders`, replay_buffer/leases.py); and room a holder leaves unused for `ttl` seconds after
  its last grant or fragment goes back too (the fallback while the rollout-manager cannot be asked). A
  call granted nothing does not keep a holder's room alive. Room goes out in tiers (room.grant): fragments
  that go on with an episode under way within the worker's share of the band (the band over the
  `fleet`'s workers, less the room it holds), then fragments that would begin one (`starting`) within
  it, then each beyond the share; a tier waits behind the other holders' unmet asks of the tiers before
  it (remembered for room.DEMAND_SECONDS). The fleet finishes what it started, and a worker that joins
  gets its share even when the others ask first every time room frees.
- A blob key that the orphan sweeper claimed (`claim_orphans`) is never indexed afterwards: `add`
  answers "swept" and the front writes the blob again under a new key. So an index entry always has
  its blob.
- A claim made for a reader that fetches the blobs itself (`claim(n, by_ref=True)`) is remembered
  (`ref_claim_age`), so that every front keeps the blobs of chunks that leave the index for the ref
  grace period while such readers are about.
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from overworld.replay_buffer.rate_limiter import RateLimiter
from overworld.replay_buffer.room import MemoryRoom

# add() statuses
OK = "ok"
DUPLICATE = "duplicate"  # already indexed (or consumed): acknowledge, change nothing
BLOCKED = "blocked"  # the rate limiter refuses inserts now: retry once samples have been drawn
SWEPT = "swept"  # the blob key was claimed by the orphan sweeper: write the blob again, new key

SWEPT_RETENTION_SECONDS = 24 * 3600.0  # how long a sweeper tombstone is kept
SAMPLE_ORDERS = ("oldest", "uniform")


class IndexUnavailable(RuntimeError):
    """The index backend cannot be reached; the front answers UNAVAILABLE so that clients retry."""


@dataclass(frozen=True)
class FragmentMeta:
    slot_key: str
    sequence: int
    first_model_version: int
    nbytes: int
    blob_key: str
    holder: str = ""  # the worker id: a fragment takes the room its worker reserved


@dataclass
class Chunk:
    chunk_id: int
    fragments: list[FragmentMeta]
    times_sampled: int = 0

    @property
    def first_model_version(self) -> int:
        return self.fragments[0].first_model_version

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fragments)

    @property
    def blob_keys(self) -> list[str]:
        return [f.blob_key for f in self.fragments]


@dataclass
class AddResult:
    stored: bool  # False: dropped on arrival (stale); meaningless unless status is OK or DUPLICATE
    delete_blobs: list[str] = field(default_factory=list)  # no longer referenced by the index
    status: str = OK
    dropped: dict[str, int] = field(default_factory=dict)  # chunks dropped by this call, by reason


@dataclass
class Claim:
    chunk: Chunk  # times_sampled already counts this claim
    final: bool  # the chunk left the index with this claim; delete its blobs after sending


@dataclass
class VersionMove:
    dropped_chunks: int
    delete_blobs: list[str]


@dataclass
class IndexStats:
    fragments: int
    chunks: int
    bytes: int
    inserted_fragments: int
    sampled_chunks: int
    dropped: dict[str, int]
    model_version: int
    mean_reuse: float
    mean_staleness: float
    max_staleness: int
    reserved_fragments: int = 0
    expired_reservations: int = 0  # fragments' room given back because its holder went quiet


class ReplayIndex(Protocol):
    limiter: RateLimiter | None

    def add(self, meta: FragmentMeta) -> AddResult: ...
    def can_insert(self) -> bool: ...
    def reserve(self, holder: str, n: int, ttl: float, starting: int = 0, fleet: int = 1) -> int: ...
    def release(self, holder: str, n: int) -> None: ...
    def holders(self) -> list[str]: ...
    def forget_holders(self, holders: list[str]) -> int: ...
    def claim(self, n: int, by_ref: bool = False) -> list[Claim]: ...
    def ref_claim_age(self) -> float | None: ...
    def set_model_version(self, version: int) -> VersionMove: ...
    def model_version(self) -> int: ...
    def stats(self) -> IndexStats: ...
    def describe_wait(self) -> str: ...
    def unreferenced(self, keys: list[str]) -> list[str]: ...
    def claim_orphans(self, keys: list[str]) -> list[str]: ...
    def reset(self, token: str | None = None) -> list[str] | None: ...
    def close(self) -> None: ...


class MemoryIndex:
    def __init__(self, max_chunks: int, max_reuse: int, max_staleness: int, fragments_per_chunk: int,
                 rate_limiter: RateLimiter | None = None, seed: int | None = None,
                 sample_order: str = "oldest") -> None:
        if sample_order not in SAMPLE_ORDERS:
            raise ValueError(f"sample_order must be one of {SAMPLE_ORDERS}, got {sample_order!r}")
        self.sample_order = sample_order
        self.max_chunks = max_chunks
        self.max_reuse = max_reuse
        self.max_staleness = max_staleness
        self.fragments_per_chunk = fragments_per_chunk
        self.limiter = rate_limiter
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._attempt: str | None = None
        self._swept: dict[str, float] = {}
        self._ref_claimed_at: float | None = None
        self._clear()

    def _clear(self) -> None:
        self._chunks: OrderedDict[int, Chunk] = OrderedDict()  # insertion order = FIFO
        self._by_age: list[tuple[int, int]] = []  # (first model version, chunk id), sorted: oldest first
        self._partial: dict[str, list[FragmentMeta]] = {}
        self._last_seq: dict[str, int] = {}
        self._live: set[str] = set()
        self._next_chunk_id = 1
        self._version = 0
        self._inserted = 0
        self._sampled = 0
        self._dropped: dict[str, int] = defaultdict(int)
        self._reuse_sum = 0
        self._reuse_count = 0
        if self.limiter:
            self.limiter.inserts, self.limiter.samples, self.limiter.credit = 0, 0, 0.0
        self._room = MemoryRoom(self.limiter, self.fragments_per_chunk) if self.limiter else None

    def _is_stale(self, first_version: int) -> bool:
        return first_version < self._version - self.max_staleness

    def _remove(self, chunk: Chunk, reason: str) -> list[str]:
        if self._chunks.pop(chunk.chunk_id, None) is not None:
            key = (chunk.first_model_version, chunk.chunk_id)
            del self._by_age[bisect.bisect_left(self._by_age, key)]
        self._dropped[reason] += 1
        self._reuse_sum += chunk.times_sampled
        self._reuse_count += 1
        if self.limiter:
            self.limiter.removed(chunk.times_sampled)
        self._live.difference_update(chunk.blob_keys)
        return chunk.blob_keys

    def add(self, meta: FragmentMeta) -> AddResult:
        with self._lock:
            if meta.blob_key in self._swept:
                return AddResult(False, [], SWEPT)
            last = self._last_seq.get(meta.slot_key)
            if last is not None and meta.sequence <= last:
                # A resend: the original is (or was) indexed. Same key: a retried add of this very blob.
                own = [] if meta.blob_key in self._live else [meta.blob_key]
                return AddResult(True, own, DUPLICATE)
            if self._room is not None and not self._room.take(meta.holder) and not self._room.limiter.can_insert():
                return AddResult(False, [], BLOCKED)
            self._last_seq[meta.slot_key] = meta.sequence
            self._inserted += 1
            delete: list[str] = []
            dropped: dict[str, int] = defaultdict(int)
            partial = self._partial.get(meta.slot_key, [])
            if partial and partial[-1].sequence + 1 != meta.sequence:
                self._dropped["incomplete"] += 1
                dropped["incomplete"] += 1
                delete += [f.blob_key for f in partial]
                self._live.difference_update(f.blob_key for f in partial)
                partial = []
            if not partial and self._is_stale(meta.first_model_version):
                self._dropped["stale_on_arrival"] += 1
                dropped["stale_on_arrival"] += 1
                self._partial.pop(meta.slot_key, None)
                return AddResult(False, [*delete, meta.blob_key], OK, dict(dropped))
            partial = [*partial, meta]
            self._live.add(meta.blob_key)
            if len(partial) < self.fragments_per_chunk:
                self._partial[meta.slot_key] = partial
                return AddResult(True, delete, OK, dict(dropped))
            self._partial.pop(meta.slot_key, None)
            chunk = Chunk(self._next_chunk_id, partial)
            self._next_chunk_id += 1
            if self._is_stale(chunk.first_model_version):
                self._dropped["stale_on_arrival"] += 1
                dropped["stale_on_arrival"] += 1
                self._live.difference_update(chunk.blob_keys)
                return AddResult(False, [*delete, *chunk.blob_keys], OK, dict(dropped))
            self._chunks[chunk.chunk_id] = chunk
            bisect.insort(self._by_age, (chunk.first_model_version, chunk.chunk_id))
            if self.limiter:
                self.limiter.inserts += 1
            while len(self._chunks) > self.max_chunks:
                oldest = next(iter(self._chunks.values()))
                delete += self._remove(oldest, "evicted")
                dropped["evicted"] += 1
            return AddResult(True, delete, OK, dict(dropped))

    def can_insert(self) -> bool:
        with self._lock:
            return self.limiter is None or self.limiter.can_insert()

    # -- reservations (room.py) ----------------------------------------------------------------------
    def reserve(self, holder: str, n: int, ttl: float, starting: int = 0, fleet: int = 1) -> int:
        """Reserve room for up to n fragments of `holder` (all n without a rate limiter), of which `starting`
        would begin new episodes; `fleet`: the workers that share the band. Returns how many."""
        with self._lock:
            return n if self._room is None else self._room.reserve(holder, n, ttl, starting, fleet)

    def release(self, holder: str, n: int) -> None:
        with self._lock:
            if self._room is not None:
                self._room.release(holder, n)

    def holders(self) -> list[str]:
        """The holders that hold room now."""
        with self._lock:
            return sorted(self._room.reservations) if self._room is not None else []

    def forget_holders(self, holders: list[str]) -> int:
        """Give back all the room of these holders (their leases are gone), counted as expired; returns
        how many fragments' room came back."""
        with self._lock:
            return self._room.forget(holders) if self._room is not None else 0

    def claim(self, n: int, by_ref: bool = False) -> list[Claim]:
        """Claim up to n distinct chunks in `sample_order`, as far as the rate limiter allows. by_ref: the
        reader fetches the blobs itself (remembered for ref_claim_age)."""
        with self._lock:
            if self.sample_order == "oldest":
                picked = [chunk_id for _, chunk_id in self._by_age[:n]]
            else:
                ids = list(self._chunks)
                picked = self._rng.sample(ids, min(n, len(ids)))
            claims = []
            for chunk_id in picked:
                if self.limiter:
                    if not self.limiter.can_sample(len(self._chunks)):
                        break
                    self.limiter.samples += 1
                chunk = self._chunks[chunk_id]
                chunk.times_sampled += 1
                self._sampled += 1
                final = chunk.times_sampled >= self.max_reuse
                if final:
                    self._remove(chunk, "reused")
                claims.append(Claim(Chunk(chunk.chunk_id, list(chunk.fragments), chunk.times_sampled), final))
            if by_ref and claims:
                self._ref_claimed_at = time.monotonic()
            return claims

    def ref_claim_age(self) -> float | None:
        """Seconds since the last claim by reference that claimed something (None: there was none)."""
        with self._lock:
            return None if self._ref_claimed_at is None else time.monotonic() - self._ref_claimed_at

    def set_model_version(self, version: int) -> VersionMove:
        with self._lock:
            if version < self._version:
                raise ValueError(f"model version cannot go back from {self._version} to {version}")
            self._version = version
            delete: list[str] = []
            stale = [c for c in self._chunks.values() if self._is_stale(c.first_model_version)]
            for chunk in stale:
                delete += self._remove(chunk, "stale")
            return VersionMove(len(stale), delete)

    def model_version(self) -> int:
        with self._lock:
            return self._version

    def stats(self) -> IndexStats:
        with self._lock:
            chunks = list(self._chunks.values())
            staleness = [max(0, self._version - c.first_model_version) for c in chunks]
            return IndexStats(
                fragments=sum(len(c.fragments) for c in chunks) + sum(len(p) for p in self._partial.values()),
                chunks=len(chunks),
                bytes=sum(c.nbytes for c in chunks) + sum(f.nbytes for p in self._partial.values() for f in p),
                inserted_fragments=self._inserted,
                sampled_chunks=self._sampled,
                dropped=dict(self._dropped),
                model_version=self._version,
                mean_reuse=self._reuse_sum / self._reuse_count if self._reuse_count else 0.0,
                mean_staleness=sum(staleness) / len(staleness) if staleness else 0.0,
                max_staleness=max(staleness, default=0),
                reserved_fragments=self._room.reserved if self._room is not None else 0,
                expired_reservations=self._room.expired if self._room is not None else 0,
            )

    def describe_wait(self) -> str:
        with self._lock:
            text = f"{len(self._chunks)} chunks in the buffer"
            return f"{text}; {self.limiter.describe()}" if self.limiter else text

    def unreferenced(self, keys: list[str]) -> list[str]:
        """The keys that no index entry references (a read: nothing is tombstoned)."""
        with self._lock:
            return [k for k in keys if k not in self._live]

    def claim_orphans(self, keys: list[str]) -> list[str]:
        """The keys that no index entry references, tombstoned so that `add` refuses them from now on."""
        with self._lock:
            now = time.time()
            orphans = [k for k in keys if k not in self._live]
            for k in orphans:
                self._swept[k] = now
            for k in [k for k, t in self._swept.items() if t < now - SWEPT_RETENTION_SECONDS]:
                del self._swept[k]
            return orphans

    def reset(self, token: str | None = None) -> list[str] | None:
        """Discard the run's buffered data (counters and model version included) and return the blob
        keys to delete; with a token, only the first call with that token does so (None after)."""
        with self._lock:
            if token is not None and token == self._attempt:
                return None
            live = sorted(self._live)
            self._clear()
            self._attempt = token
            return live

    def close(self) -> None:
        pass
