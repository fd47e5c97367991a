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

from collections import deque
from dataclasses import dataclass

from overworld.model_registry.payload import MAX_FETCH_MESSAGES

RELAY_CHUNK = 512 << 10  # a hop costs about one message's transfer: keep them small
REGISTRY = ""  # a source that is the registry itself


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
        self._slots: list[deque[str]] = []
        relays = [m for m in members if m.address]
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

    def _star_if_alone(self, member: Member) -> None:
        """A watcher that does not relay and has no relay to fetch from fetches as from the star: in
        the registry's own messages, which it views without a copy."""
        if not member.address and all(s == REGISTRY for s in self.sources[member.watcher]):
            self.sources[member.watcher] = []

    def children(self, address: str) -> int:
        """How many stripe transfers the relay at `address` serves (for tests and logs)."""
        return sum(sources.count(address) for sources in self.sources.values())
