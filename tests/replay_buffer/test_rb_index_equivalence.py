"""The Redis index and the memory index are the same state machine: random operation sequences
give identical results and statistics. In the "oldest" order claims of any size must pick the same
chunks in the same order; in the "uniform" order claims take every chunk, so randomness cannot differ."""

from __future__ import annotations

import dataclasses
import random

import pytest

from overworld.replay_buffer.index import FragmentMeta, MemoryIndex
from overworld.replay_buffer.rate_limiter import RateLimiter


@pytest.mark.parametrize("limited", [True, False], ids=["rate-limited", "unlimited"])
@pytest.mark.parametrize("order", ["oldest", "uniform"])
@pytest.mark.parametrize("seed", [1, 3, 4, 5])
def test_random_operations_match(redis_server, seed, order, limited):
    from overworld.replay_buffer.redis_index import RedisIndex

    rng = random.Random(seed)
    params = {"max_chunks": rng.choice([2, 5, 50]), "max_reuse": rng.choice([1, 2, 3]),
              "max_staleness": rng.choice([0, 1, 3]), "fragments_per_chunk": rng.choice([1, 2, 3]),
              "sample_order": order}
    spi = 1.0 if limited else None

    def limiter():
        return RateLimiter.create(spi, 2.0, 1, params["max_reuse"])

    class P:  # a ReplayBufferConfig stand-in
        pass

    rb = P()
    rb.__dict__.update(params)
    mem = MemoryIndex(params["max_chunks"], params["max_reuse"], params["max_staleness"],
                      params["fragments_per_chunk"], limiter(), sample_order=order)
    red = RedisIndex.from_url(redis_server.url, f"eq-{seed}-{order}-{limited}-{rng.random()}", rb, limiter())
    try:
        seqs = {s: 0 for s in range(3)}
        version = 0
        for step in range(300):
            op = rng.random()
            if op < 0.12:
                # room: reserved (some of it to begin episodes: served after the others' asks), given back,
                # or the holder's lease gone
                holder, kind = rng.choice(["h1", "h2", "h3"]), rng.random()
                if kind < 0.6:
                    n, fleet = rng.randrange(0, 4), rng.choice([1, 2, 3])
                    starting = rng.randrange(0, n + 1)
                    assert mem.reserve(holder, n, 60.0, starting, fleet) == red.reserve(holder, n, 60.0, starting,
                                                                                        fleet), step
                elif kind < 0.85:
                    n = rng.randrange(1, 4)
                    mem.release(holder, n)
                    red.release(holder, n)
                else:
                    assert mem.holders() == red.holders(), step
                    assert mem.forget_holders([holder]) == red.forget_holders([holder]), step
            elif op < 0.6:
                slot = rng.randrange(3)
                if rng.random() < 0.1:
                    seqs[slot] += 1  # a gap
                elif rng.random() < 0.1 and seqs[slot] > 0:
                    seqs[slot] -= 1  # a resend
                meta = FragmentMeta(f"w/{slot}", seqs[slot], max(0, version - rng.choice([0, 0, 1, 2, 4])),
                                    rng.randrange(1, 1000), f"k{step}", rng.choice(["", "h1", "h2"]))
                a, b = mem.add(meta), red.add(meta)
                assert (a.status, a.stored, sorted(a.delete_blobs), a.dropped) == \
                       (b.status, b.stored, sorted(b.delete_blobs), b.dropped), step
                if a.status == "ok" or a.status == "duplicate":
                    seqs[slot] += 1
            elif op < 0.85 and order == "oldest":
                a, b = mem.claim(n := rng.randrange(1, 5)), red.claim(n)
                key = lambda claims: [(c.chunk.chunk_id, c.chunk.times_sampled, c.final,  # noqa: E731
                                       tuple(c.chunk.blob_keys)) for c in claims]
                assert key(a) == key(b), step
            elif op < 0.85:
                # Claims take every chunk, so that the random choice cannot differ; with a rate limiter
                # (which may stop part-way) only when there is a single chunk to choose.
                if spi is not None and mem.stats().chunks != 1:
                    continue
                a, b = mem.claim(10_000), red.claim(10_000)
                key = lambda claims: sorted((c.chunk.chunk_id, c.chunk.times_sampled, c.final,  # noqa: E731
                                             tuple(c.chunk.blob_keys)) for c in claims)
                assert key(a) == key(b), step
            elif op < 0.95:
                version += rng.choice([0, 1, 1, 2])
                a, b = mem.set_model_version(version), red.set_model_version(version)
                assert (a.dropped_chunks, sorted(a.delete_blobs)) == (b.dropped_chunks, sorted(b.delete_blobs))
            else:
                keys = [f"k{rng.randrange(step + 1)}" for _ in range(3)] + [f"orphan{step}"]
                assert sorted(mem.claim_orphans(keys)) == sorted(red.claim_orphans(keys))
            sa, sb = dataclasses.asdict(mem.stats()), dataclasses.asdict(red.stats())
            assert sa.pop("mean_staleness") == pytest.approx(sb.pop("mean_staleness")), step
            assert sa == sb, step
            assert mem.can_insert() == red.can_insert()
        assert mem.describe_wait() == red.describe_wait()
    finally:
        red.reset()
        red.close()
