"""The room workers reserved (index.py says what reserving means): the memory index's bookkeeping of it,
and what the Redis index's scripts share with it. `MemoryRoom` is not locked: the memory index calls it
under its own lock."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from overworld.replay_buffer.rate_limiter import RateLimiter

DEMAND_SECONDS = 2.0  # how long a holder's unmet ask for room to go on with its episodes counts (it asks again)


@dataclass
class _Reservation:
    ttl: float
    fragments: int = 0
    expires_at: float = 0.0

    def touch(self) -> None:
        """The holder is alive (it was granted room, or a fragment of its arrived): its room is kept ttl longer."""
        self.expires_at = time.monotonic() + self.ttl


class MemoryRoom:
    def __init__(self, limiter: RateLimiter, fragments_per_chunk: int) -> None:
        self.limiter = limiter
        self.fragments_per_chunk = fragments_per_chunk
        self.reservations: dict[str, _Reservation] = {}  # by holder
        self.demand: dict[str, tuple[int, float]] = {}  # holder -> (continuing fragments it waits for, until)
        self.reserved = 0  # fragments, all holders
        self.expired = 0  # fragments' room given back because its holder went quiet or lost its lease
        self.limiter.reserved = 0.0

    def reserve(self, holder: str, n: int, ttl: float, starting: int, fleet: int) -> int:
        self.expire()
        now = time.monotonic()
        room = self.limiter.room(self.fragments_per_chunk)
        continuing = n - starting
        going_on = min(continuing, room)
        share = max(1, math.ceil(self.limiter.band(self.fragments_per_chunk) / max(1, fleet)))
        self.demand = {h: d for h, d in self.demand.items() if d[1] > now and h != holder}
        others = sum(min(count, share) for count, _ in self.demand.values())
        granted = going_on + min(starting, max(0, room - going_on - others))
        if continuing > going_on:
            self.demand[holder] = (continuing - going_on, now + DEMAND_SECONDS)
        if granted:
            held = self.reservations.setdefault(holder, _Reservation(ttl))
            held.fragments += granted
            held.ttl = ttl
            held.touch()
            self.reserved += granted
            self._sync_limiter()
        return granted

    def release(self, holder: str, n: int) -> None:
        self.demand.pop(holder, None)
        held = self.reservations.get(holder)
        if held is not None:
            self._give_back(holder, held, min(n, held.fragments))
            self._sync_limiter()

    def forget(self, holders: list[str]) -> int:
        back = 0
        for holder in holders:
            self.demand.pop(holder, None)
            held = self.reservations.pop(holder, None)
            if held is not None:
                back += held.fragments
        self.reserved -= back
        self.expired += back
        self._sync_limiter()
        return back

    def take(self, holder: str) -> bool:
        """One fragment of `holder` takes room it reserved: True if it had some."""
        self.expire()
        held = self.reservations.get(holder)
        if held is None:
            return False
        held.touch()
        self._give_back(holder, held, 1)
        self._sync_limiter()
        return True

    def expire(self) -> None:
        now = time.monotonic()
        for holder in [h for h, held in self.reservations.items() if held.expires_at <= now]:
            count = self.reservations.pop(holder).fragments
            self.reserved -= count
            self.expired += count
        self._sync_limiter()

    def _give_back(self, holder: str, held: _Reservation, n: int) -> None:
        held.fragments -= n
        self.reserved -= n
        if held.fragments <= 0:
            del self.reservations[holder]

    def _sync_limiter(self) -> None:
        self.limiter.reserved = self.reserved / self.fragments_per_chunk
