"""The room workers reserved (index.py says what reserving means): the memory index's bookkeeping of it,
and what the Redis index's scripts share with it. `MemoryRoom` is not locked: the memory index calls it
under its own lock."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from overworld.replay_buffer.rate_limiter import RateLimiter

DEMAND_SECONDS = 2.0  # how long a holder's unmet ask for room counts ahead of the others' (it asks again)


@dataclass(frozen=True)
class Ask:
    """Room a holder waits for: fragments going on with episodes under way, fragments beginning new ones,
    and the room it already holds."""

    continuing: int
    starting: int
    held: int

    def tiers(self, share: int) -> tuple[int, int, int, int]:
        """(continuing, starting) within the holder's share of the band (less what it holds), then beyond."""
        within = max(0, share - self.held)
        continuing = min(self.continuing, within)
        starting = min(self.starting, within - continuing)
        return continuing, starting, self.continuing - continuing, self.starting - starting


def grant(room: int, ask: Ask, others: list[Ask], share: int) -> tuple[int, int]:
    """(continuing, starting) fragments of `ask` granted out of `room`, the other holders' unmet asks
    `others` counted ahead where their tier comes first. In order: episodes under way within each worker's
    share, episodes begun within it, episodes under way beyond it, episodes begun beyond it. So the fleet
    finishes what it started, and a worker that joins one whose workers could use the whole band still
    gets its share (redis_scripts.RESERVE is the same rule in Lua)."""
    ahead = [0, 0, 0, 0]  # the others' fragments in each tier
    for other in others:
        ahead = [a + t for a, t in zip(ahead, other.tiers(share), strict=True)]
    granted = []
    for tier, wanted in enumerate(ask.tiers(share)):
        g = min(wanted, max(0, room - sum(ahead[:tier])))
        room -= g
        granted.append(g)
    return granted[0] + granted[2], granted[1] + granted[3]


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
        self.demand: dict[str, tuple[int, int, float]] = {}  # holder -> (continuing, starting it waits for, until)
        self.reserved = 0  # fragments, all holders
        self.expired = 0  # fragments' room given back because its holder went quiet or lost its lease
        self.limiter.reserved = 0.0

    def reserve(self, holder: str, n: int, ttl: float, starting: int, fleet: int) -> int:
        self.expire()
        now = time.monotonic()
        share = max(1, math.ceil(self.limiter.band(self.fragments_per_chunk) / max(1, fleet)))
        self.demand = {h: d for h, d in self.demand.items() if d[2] > now and h != holder}
        others = [Ask(c, s, self._held(h)) for h, (c, s, _) in self.demand.items()]
        ask = Ask(n - starting, starting, self._held(holder))
        going_on, begun = grant(self.limiter.room(self.fragments_per_chunk), ask, others, share)
        if going_on < ask.continuing or begun < ask.starting:
            self.demand[holder] = (ask.continuing - going_on, ask.starting - begun, now + DEMAND_SECONDS)
        granted = going_on + begun
        if granted:
            held = self.reservations.setdefault(holder, _Reservation(ttl))
            held.fragments += granted
            held.ttl = ttl
            held.touch()
            self.reserved += granted
            self._sync_limiter()
        return granted

    def _held(self, holder: str) -> int:
        held = self.reservations.get(holder)
        return held.fragments if held is not None else 0

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
