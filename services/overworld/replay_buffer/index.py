"""The replay index: which fragments form which chunks, how often each chunk was sampled, and
what to drop. `MemoryIndex` is the embedded backend; the Redis backend keeps the same semantics.

Semantics (MineStudio's replay_buffer_config, made exact):
- `fragments_per_chunk` consecutive fragments (by sequence number) of one env slot form a chunk;
  a gap in the sequence discards the partial chunk ("incomplete").
- `max_chunks`: the oldest chunk is evicted when a new one would exceed it ("evicted").
- `max_reuse`: a chunk is removed once it has been sampled that many times ("reused").
- `max_staleness`: a chunk whose first step is older than model_version - max_staleness is dropped
  on arrival and whenever the model version moves ("stale").
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from overworld.replay_buffer.rate_limiter import RateLimiter


@dataclass(frozen=True)
class FragmentMeta:
    slot_key: str
    sequence: int
    first_model_version: int
    nbytes: int
    blob_key: str


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
    stored: bool  # False: dropped on arrival
    delete_blobs: list[str] = field(default_factory=list)


@dataclass
class Claim:
    chunk: Chunk  # times_sampled already counts this claim
    final: bool  # the chunk left the index with this claim; delete its blobs after sending


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


class ReplayIndex(Protocol):
    def add(self, meta: FragmentMeta) -> AddResult: ...
    def can_insert(self) -> bool: ...
    def claim(self, n: int) -> list[Claim]: ...
    def set_model_version(self, version: int) -> list[str]: ...
    def model_version(self) -> int: ...
    def stats(self) -> IndexStats: ...
    def describe_wait(self) -> str: ...


class MemoryIndex:
    def __init__(self, max_chunks: int, max_reuse: int, max_staleness: int, fragments_per_chunk: int,
                 rate_limiter: RateLimiter | None = None, seed: int | None = None) -> None:
        self.max_chunks = max_chunks
        self.max_reuse = max_reuse
        self.max_staleness = max_staleness
        self.fragments_per_chunk = fragments_per_chunk
        self.limiter = rate_limiter
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._chunks: OrderedDict[int, Chunk] = OrderedDict()  # insertion order = FIFO
        self._partial: dict[str, list[FragmentMeta]] = {}
        self._next_chunk_id = 1
        self._version = 0
        self._inserted = 0
        self._sampled = 0
        self._dropped: dict[str, int] = defaultdict(int)
        self._reuse_sum = 0
        self._reuse_count = 0

    def _is_stale(self, first_version: int) -> bool:
        return first_version < self._version - self.max_staleness

    def _remove(self, chunk: Chunk, reason: str) -> list[str]:
        self._chunks.pop(chunk.chunk_id, None)
        self._dropped[reason] += 1
        self._reuse_sum += chunk.times_sampled
        self._reuse_count += 1
        if self.limiter:
            self.limiter.removed(chunk.times_sampled)
        return chunk.blob_keys

    def add(self, meta: FragmentMeta) -> AddResult:
        with self._lock:
            self._inserted += 1
            delete: list[str] = []
            partial = self._partial.get(meta.slot_key, [])
            if partial and partial[-1].sequence + 1 != meta.sequence:
                self._dropped["incomplete"] += 1
                delete += [f.blob_key for f in partial]
                partial = []
            if not partial and self._is_stale(meta.first_model_version):
                self._dropped["stale"] += 1
                self._partial.pop(meta.slot_key, None)
                return AddResult(False, [*delete, meta.blob_key])
            partial = [*partial, meta]
            if len(partial) < self.fragments_per_chunk:
                self._partial[meta.slot_key] = partial
                return AddResult(True, delete)
            self._partial.pop(meta.slot_key, None)
            chunk = Chunk(self._next_chunk_id, partial)
            self._next_chunk_id += 1
            if self._is_stale(chunk.first_model_version):
                self._dropped["stale"] += 1
                return AddResult(False, [*delete, *chunk.blob_keys])
            self._chunks[chunk.chunk_id] = chunk
            if self.limiter:
                self.limiter.inserts += 1
            while len(self._chunks) > self.max_chunks:
                oldest = next(iter(self._chunks.values()))
                delete += self._remove(oldest, "evicted")
            return AddResult(True, delete)

    def can_insert(self) -> bool:
        with self._lock:
            return self.limiter is None or self.limiter.can_insert()

    def claim(self, n: int) -> list[Claim]:
        """Claim up to n distinct chunks, uniformly at random, as far as the rate limiter allows."""
        with self._lock:
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
            return claims

    def set_model_version(self, version: int) -> list[str]:
        with self._lock:
            if version < self._version:
                raise ValueError(f"model version cannot go back from {self._version} to {version}")
            self._version = version
            delete: list[str] = []
            for chunk in [c for c in self._chunks.values() if self._is_stale(c.first_model_version)]:
                delete += self._remove(chunk, "stale")
            return delete

    def model_version(self) -> int:
        with self._lock:
            return self._version

    def stats(self) -> IndexStats:
        with self._lock:
            chunks = list(self._chunks.values())
            staleness = [self._version - c.first_model_version for c in chunks]
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
            )

    def describe_wait(self) -> str:
        with self._lock:
            text = f"{len(self._chunks)} chunks in the buffer"
            return f"{text}; {self.limiter.describe()}" if self.limiter else text
