"""The relay planner: every stripe reaches every watcher through a tree the registry feeds once,
no relay sends more than one copy, and the trees stay log(N) deep."""

from __future__ import annotations

import math

import pytest

from overworld.model_registry.relay_plan import REGISTRY, Member, RelayPlan, relay_chunk_bytes, stripe_bounds


def fleet(n: int, relaying: bool = True) -> list[Member]:
    return [Member(f"w{i}", f"10.0.0.{i}:50056" if relaying else "") for i in range(n)]


def depth(plan: RelayPlan, members: list[Member], watcher: str, stripe: int) -> int:
    by_address = {m.address: m.watcher for m in members if m.address}
    hops, current = 0, watcher
    while True:
        hops += 1
        assert hops <= len(members) + 1, f"stripe {stripe} of {watcher} loops"
        source = plan.sources[current][stripe]
        if source == REGISTRY:
            return hops
        current = by_address[source]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16, 32, 100, 1024])
@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_every_stripe_reaches_everyone_and_each_link_carries_at_most_a_copy(n: int, fanout: int) -> None:
    members = fleet(n)
    plan = RelayPlan(members, fanout)
    for m in members:
        assert len(plan.sources[m.watcher]) == fanout
    for stripe in range(fanout):
        # the registry sends each stripe once: one copy of the version in all
        assert sum(plan.sources[m.watcher][stripe] == REGISTRY for m in members) == 1
        for m in members:
            assert plan.sources[m.watcher][stripe] != m.address  # nobody is its own source
    # a relay forwards stripes (1/fanout of the version each) to at most fanout watchers in all: a copy
    for m in members:
        served = [stripe for stripe in range(fanout) for w in members if plan.sources[w.watcher][stripe] == m.address]
        # (with fanout 3 and up, when N mod fanout >= 2, a relay serves a second tree too)
        assert len(served) <= (fanout if fanout <= 2 else 2 * fanout), (m, served)
        if fanout <= 2 and n >= fanout:
            assert len(set(served)) <= 1, (m, served)  # interior in one tree only
    levels = max(depth(plan, members, m.watcher, s) for m in members for s in range(fanout))
    bound = n if fanout == 1 else math.ceil(math.log(max(n, 2), fanout)) + 2
    assert levels <= bound, (levels, bound)


def test_watchers_that_cannot_relay_are_leaves_or_fetch_as_from_the_star() -> None:
    members = fleet(4) + [Member("plain", "")]
    plan = RelayPlan(members, 2)
    assert all(s != REGISTRY for s in plan.sources["plain"])  # fed by relays
    alone = RelayPlan([Member("plain", "")], 2)
    assert alone.sources["plain"] == []  # nobody to relay: the whole version from the registry
    assert RelayPlan([Member("a", ""), Member("b", "")], 2).place(Member("b", "")) == []


def test_a_watcher_that_connects_during_a_push_is_placed_as_a_leaf() -> None:
    members = fleet(8)
    plan = RelayPlan(members, 2)
    late = Member("late", "10.0.0.99:50056")
    sources = plan.place(late)
    assert len(sources) == 2 and all(s in {m.address for m in members} for s in sources)
    assert plan.place(late) == sources  # asked again (a reconnect), the same answer
    assert plan.children(late.address) == 0


def test_a_fleet_larger_than_the_slots_falls_back_to_the_registry() -> None:
    members = fleet(3) + [Member(f"p{i}", "") for i in range(10)]
    plan = RelayPlan(members, 2)
    for m in members[:3]:
        assert len(plan.sources[m.watcher]) == 2
    fed = [m for m in members[3:] if plan.sources[m.watcher]]
    assert fed and all(any(s != REGISTRY for s in plan.sources[m.watcher]) for m in fed)
    # the rest, with no relay slot left, fetch the whole version from the registry
    assert [m for m in members[3:] if not plan.sources[m.watcher]]


def test_stripes_are_whole_messages_that_cover_the_version() -> None:
    for size, chunk, stripes in [(0, 512, 2), (1, 512, 2), (512, 512, 2), (513, 512, 2), (10_000, 512, 3),
                                 (50 << 20, relay_chunk_bytes(50 << 20), 2)]:
        bounds = stripe_bounds(size, chunk, stripes)
        assert len(bounds) == stripes
        assert bounds[0][0] == 0 and bounds[-1][1] == size
        for (_, a1), (b0, _) in zip(bounds, bounds[1:], strict=False):
            assert a1 == b0
        for start, end in bounds:
            assert start % chunk == 0 and (end % chunk == 0 or end == size)
    with pytest.raises(ValueError):
        stripe_bounds(10, 0, 2)
    assert relay_chunk_bytes(1 << 20) == 512 << 10
    assert -(-(8 << 30) // relay_chunk_bytes(8 << 30)) <= 4096  # a registry's largest model, within its message limit


def test_a_reported_relay_is_a_leaf_for_the_next_versions_then_relays_again() -> None:
    from overworld.model_registry.relay_plan import EXCLUDED_VERSIONS, RelayExclusions

    members = [Member(f"w{i}", f"10.0.0.{i}:50066") for i in range(6)]
    exclusions = RelayExclusions()
    exclusions.report("w2", "lied", version=7)  # by the watcher the registry knows, not an address
    for version in (8, 7 + EXCLUDED_VERSIONS):
        plan = RelayPlan(exclusions.apply(members, version), 2)
        assert plan.children("10.0.0.2:50066") == 0 and plan.sources["w2"] != []  # a leaf, still fed
        assert plan.children("10.0.0.0:50066") > 0
    assert RelayPlan(exclusions.apply(members, 8 + EXCLUDED_VERSIONS), 2).children("10.0.0.2:50066") > 0
    with pytest.raises(ValueError):
        exclusions.report("w3", "slow", version=7)  # only a lie or a stall is a fault
    with pytest.raises(ValueError):
        exclusions.report("", "lied", version=7)
