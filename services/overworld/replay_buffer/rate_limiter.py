"""Samples-per-insert rate limiter in the manner of Reverb, counted in chunks.

diff = inserts * spi - samples - credit. An insert is allowed while diff + spi <= max_diff, a sample
while the buffer holds min_size chunks and diff - 1 >= min_diff, where min_diff/max_diff are
spi * min_size -/+ error. A chunk that leaves the buffer after k < spi samples (stale, evicted)
credits the missing spi - k samples, so that dropped data can never block the inserters forever.
"""

from __future__ import annotations

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

    def can_insert(self) -> bool:
        return self.diff + self.samples_per_insert <= self.offset + self.error

    def can_sample(self, size: int) -> bool:
        return size >= self.min_size and self.diff - 1 >= self.offset - self.error

    def removed(self, times_sampled: int) -> None:
        self.credit += max(0.0, self.samples_per_insert - times_sampled)

    def describe(self) -> str:
        return (f"rate limiter: {self.inserts} chunks inserted, {self.samples} sampled, "
                f"diff {self.diff:.1f} within [{self.offset - self.error:.1f}, {self.offset + self.error:.1f}]")
