"""Relay planning: which worker each watcher fetches each stripe of a new version from.

A version is cut into `fanout` stripes of whole messages. Stripe i travels down a tree of its own:
the registry sends it once, to the tree's root, and every interior node forwards it to `fanout`
children as the messages arrive. Each relaying watcher is interior in exactly one tree (round
robin) and a leaf in the others, so it receives one copy of the version and sends one copy on: the
registry's link carries one copy whatever the fleet size, no worker's link carries more than one copy
each way, and the version arrives in about one copy's transfer time plus a message's time per level
(log_fanout(N) levels). This is SplitStream's layout (and NCCL's double binary tree for fanout 2);
docs/model_registry.md says why it was chosen over a single tree or a chain.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace

from prometheus_client import Counter

from overworld.model_registry.payload import MAX_FETCH_MESSAGES

log = logging.getLogger("overworld.model_registry")

RELAYS_EXCLUDED = Counter("overworld_registry_relays_excluded_total",
                          "Relays left out of the next plans: a child reported that one lied or stalled", ["reason"])

RELAY_CHUNK = 512 << 10  # a hop costs about one message's transfer: keep them small
REGISTRY = ""  # a source that is the registry itself
EXCLUDED_VERSIONS = 10  # a relay reported as failed relays none of the next this many versions
FAULTS = ("lied", "stalled")


def relay_chunk_bytes(size: int) -> int:
    """The message size of relayed transfers of a `size`-byte version: RELAY_CHUNK, or larger where a
    version would otherwise take more than MAX_FETCH_MESSAGES messages."""
    least = -(-size // MAX_FETCH_MESSAGES)
    return max(RELAY_CHUNK, -(-least // 65536) * 65536)


def stripe_bounds(size: int, chunk: int, stripes: int) -> list[tuple[int, int]]:
    """The byte range [start, end) of each stripe: whole `chunk`-byte messages, as even as can be (a
    stripe is empty when there are fewer messages than stripes)."""
    if chunk <= 0 or stripes <= 0:
        raise ValueError(f"chunk {chunk} and stripes {stripes} must be positive")
    messages = -(-size // chunk)
    return [(min(i * messages // stripes * chunk, size), min((i + 1) * messages // stripes * chunk, size))
            for i in range(stripes)]


@dataclass(frozen=True)
class Member:
    """A watcher as the planner sees it: `address` is where its relay serves (host:port), "" if it
    does not relay."""

    watcher: str
    address: str
    precision: str = ""
    relayed: bool = True  # it asked for announcements with sources (WatchAnnouncements), not plain Watch


class RelayPlan:
    """The stripe trees of one version for the watchers of one precision.

    Built from the watchers connected when the version is announced, in the order they joined (so a
    plan changes little from one version to the next); a watcher that connects later is placed as a
    leaf in the slots left over (or on the registry when none are)."""

    def __init__(self, members: list[Member], fanout: int) -> None:
        if fanout < 1:
            raise ValueError("a relay plan needs a fanout of at least 1")
        self.fanout = fanout
        self.sources: dict[str, list[str]] = {}
        self.depth: dict[tuple[int, str], int] = {}  # (stripe, relay address) -> its depth (the registry's: 0)
        self._slots: list[deque[str]] = []
        relays = [m for m in members if m.address]
        self._relays = {m.address: m.watcher for m in relays}
        for stripe in range(fanout):
            # fewer relays than stripes: some relay is interior in two trees (and still sends less
            # than a copy, having fewer children than the fanout)
            interior = relays[stripe::fanout] or relays[stripe % max(1, len(relays)):][:1]
            inner = {m.watcher for m in interior}
            order = interior + [m for m in members if m.watcher not in inner]
            slots: deque[str] = deque([REGISTRY])  # breadth first: the tree stays log_fanout(N) deep
            leaves: deque[Member] = deque()  # relays placed as leaves: promoted when the slots run out
            for member in order:
                if not slots and leaves:  # N mod fanout >= 2 (fanout 3 and up): one relay serves two trees
                    slots.extend([leaves.popleft().address] * fanout)
                parent = slots.popleft() if slots else REGISTRY
                self.sources.setdefault(member.watcher, []).append(parent)
                if member.address:
                    self.depth[(stripe, member.address)] = self.depth_of(stripe, parent) + 1
                if member.watcher in inner:
                    slots.extend([member.address] * fanout)
                elif member.address:
                    leaves.append(member)
            self._slots.append(slots)
        for member in members:
            self._star_if_alone(member)

    def place(self, member: Member) -> list[str]:
        """The sources of `member`, one per stripe: [] to fetch the whole version from the registry. A
        watcher placed after the plan was made is a leaf; one with no relay slot left (many connecting at
        once, after a registry restart) fetches as from the star, in the registry's own messages."""
        if member.watcher not in self.sources:
            sources = [slots.popleft() if slots else REGISTRY for slots in self._slots]
            self.sources[member.watcher] = [] if all(s == REGISTRY for s in sources) else sources
        return self.sources[member.watcher]

    def depth_of(self, stripe: int, source: str) -> int:
        """How deep `source` is in stripe `stripe`'s tree: the registry 0, its children 1, ..."""
        return 0 if source == REGISTRY else self.depth.get((stripe, source), 1)

    def source_depths(self, watcher: str) -> list[int]:
        """The depth of each of a placed watcher's sources, stripe by stripe."""
        return [self.depth_of(stripe, source) for stripe, source in enumerate(self.sources.get(watcher, []))]

    def is_source_of(self, relay: str, watcher: str) -> bool:
        """Whether the plan gave `watcher` the relay at address `relay` as the source of some stripe."""
        return bool(relay) and relay in self.sources.get(watcher, [])

    def watcher_at(self, relay: str) -> str | None:
        """The watcher that relays from `relay` (an address) in this plan."""
        return self._relays.get(relay)

    def _star_if_alone(self, member: Member) -> None:
        """A watcher that does not relay and has no relay to fetch from fetches as from the star: in
        the registry's own messages, which it views without a copy."""
        if not member.address and all(s == REGISTRY for s in self.sources[member.watcher]):
            self.sources[member.watcher] = []

    def children(self, address: str) -> int:
        """How many stripe transfers the relay at `address` serves (for tests and logs)."""
        return sum(sources.count(address) for sources in self.sources.values())


class RelayExclusions:
    """Relays the watchers reported (a chunk that did not match its hash, a frame that did not open, or no
    data for its data stall time): each is a leaf, never a parent, in the plans of the next
    EXCLUDED_VERSIONS versions. Keyed by the watcher the registry knows (its Watch), not by an address a
    caller declares; the registry takes a report only from a watcher the plan gave that relay as a source
    (announce.py), so the worst a lying worker does is make its own parents leaves for a while."""

    def __init__(self) -> None:
        self._until: dict[str, int] = {}  # relay's watcher id -> the last version it is left out of

    def report(self, relay: str, reason: str, version: int) -> None:
        if reason not in FAULTS or not relay:
            raise ValueError(f"a relay fault names a relay and one of {FAULTS}, not {relay!r}, {reason!r}")
        if self._until.get(relay, 0) < version:  # counted once per failure, however many children saw it
            RELAYS_EXCLUDED.labels(reason).inc()
            log.warning("relay %s %s on version %d: it relays none of versions %d..%d", relay, reason, version,
                        version + 1, version + EXCLUDED_VERSIONS)
        self._until[relay] = max(self._until.get(relay, 0), version + EXCLUDED_VERSIONS)

    def excluded(self) -> set[str]:
        """The watchers left out of plans now."""
        return set(self._until)

    def apply(self, members: list[Member], version: int) -> list[Member]:
        """`members` for the plan of `version`: the excluded ones as leaves (no address to relay from)."""
        for relay in [r for r, until in self._until.items() if until < version]:
            del self._until[relay]
        return [replace(m, address="") if m.watcher in self._until else m for m in members]
