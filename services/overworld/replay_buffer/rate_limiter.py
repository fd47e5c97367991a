"""Samples-per-insert rate limiter in the manner of Reverb, counted in chunks.

diff = inserts * spi - samples - credit. An insert is allowed while diff + spi <= max_diff, a sample
while the buffer holds min_size chunks and diff - 1 >= min_diff, where min_diff/max_diff are
spi * min_size -/+ error. A chunk that leaves the buffer after k < spi samples (stale, evicted)
credits the missing spi - k samples, so that dropped data can never block the inserters forever.

Reservations (`reserved`, in chunks) move the insert side's check to where the data is made: a worker
reserves room before it steps a fragment, so a fleet larger than the learner needs steps only what the
learner will sample, and data does not go stale waiting at the door (docs/replay_buffer.md, "Reserving
before stepping"). Reserved room counts as inserted for inserts and reservations, never for samples:
a sampler cannot run ahead of data that does not exist yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from overworld.core.config import check_rate_limit


@dataclass
class RateLimiter:
    samples_per_insert: float
    error: float
    min_size: int
    inserts: int = 0
    samples: int = 0
    credit: float = 0.0
    reserved: float = 0.0  # chunks reserved by workers and not yet inserted (fragments / fragments_per_chunk)

    @classmethod
    def create(cls, samples_per_insert: float | None, error: float, min_size: int, max_reuse: int) -> RateLimiter | None:
        if samples_per_insert is None:
            return None
        check_rate_limit(samples_per_insert, error, max_reuse)
        return cls(samples_per_insert, error, max(1, min_size))

    @property
    def diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples - self.credit

    @property
    def offset(self) -> float:
        return self.samples_per_insert * self.min_size

    @property
    def insert_diff(self) -> float:
        """`diff` with the reserved chunks counted as inserted."""
        return self.diff + self.reserved * self.samples_per_insert

    def can_insert(self) -> bool:
        """An insert that was not reserved."""
        return self.insert_diff + self.samples_per_insert <= self.offset + self.error

    def can_sample(self, size: int) -> bool:
        return size >= self.min_size and self.diff - 1 >= self.offset - self.error

    def room(self, fragments_per_chunk: int) -> int:
        """How many more fragments may be reserved now."""
        per_fragment = self.samples_per_insert / fragments_per_chunk
        return max(0, math.floor((self.offset + self.error - self.insert_diff) / per_fragment + 1e-9))

    def band(self, fragments_per_chunk: int) -> int:
        """How many fragments may be in flight at most (reserved or inserted and not yet sampled)."""
        return math.floor((self.offset + self.error) / (self.samples_per_insert / fragments_per_chunk) + 1e-9)

    def removed(self, times_sampled: int) -> None:
        self.credit += max(0.0, self.samples_per_insert - times_sampled)

    def describe(self) -> str:
        reserved = f", {self.reserved:g} reserved" if self.reserved else ""
        return (f"rate limiter: {self.inserts} chunks inserted{reserved}, {self.samples} sampled, "
                f"diff {self.diff:.1f} within [{self.offset - self.error:.1f}, {self.offset + self.error:.1f}]")
