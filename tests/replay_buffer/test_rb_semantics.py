"""Every replay-buffer semantic, once per backend, over real gRPC sockets."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
import pytest
from rb_support import (
    fragment_data,
    insert,
    insert_until_error,
    make_fragment,
    requests,
    sample,
    stats,
    wait_until,
)

from overworld.core.config import ConfigError, load_config
from overworld.replay_buffer.rate_limiter import RateLimiter
from overworld.v1 import replay_buffer_pb2


def _sequences(chunk: replay_buffer_pb2.SampledChunk) -> list[int]:
    return [f.header.sequence for f in chunk.fragments]


def test_chunks_are_consecutive_fragments_of_one_slot(make_buffer):
    buf = make_buffer(fragments_per_chunk=3)
    frags = [buf.fragment(slot=s, seq=q) for q in range(3) for s in (0, 1)]  # two slots, interleaved
    acks = insert(buf.client, frags)
    assert [(a.env_slot, a.sequence, a.stored) for a in acks] == [(f.header.env_slot, f.header.sequence, True)
                                                                   for f in frags]
    st = stats(buf.client)
    assert (st.chunks, st.fragments, st.inserted_fragments) == (2, 6, 6)
    assert st.bytes == sum(f.ByteSize() for f in frags)
    chunks = sample(buf.client, 2)
    assert sorted(_sequences(c) for c in chunks) == [[0, 1, 2], [0, 1, 2]]
    for c in chunks:
        slots = {f.header.env_slot for f in c.fragments}
        assert len(slots) == 1
        # The payload comes back byte for byte.
        original = {(f.header.env_slot, f.header.sequence): f for f in frags}
        for f in c.fragments:
            assert f == original[(f.header.env_slot, f.header.sequence)]


def test_gap_discards_incomplete_chunk(make_buffer):
    buf = make_buffer(fragments_per_chunk=3)
    insert(buf.client, [buf.fragment(seq=q) for q in (0, 1, 3, 4, 5)])
    st = stats(buf.client)
    assert st.dropped_chunks["incomplete"] == 1
    assert (st.chunks, st.fragments) == (1, 3)
    # The blobs of the discarded partial chunk are deleted too.
    wait_until(lambda: len(buf.blob_keys()) == 3, what="blobs of the incomplete chunk deleted")
    assert [_sequences(c) for c in sample(buf.client, 1)] == [[3, 4, 5]]


def test_partial_chunk_is_held_but_not_sampled(make_buffer):
    buf = make_buffer(fragments_per_chunk=2)
    insert(buf.client, [buf.fragment(seq=0)])
    st = stats(buf.client)
    assert (st.chunks, st.fragments) == (0, 1)
    assert sample(buf.client, 1, timeout=0.2, allow_partial=True) == []


def test_oldest_chunk_evicted_at_max_chunks(make_buffer):
    buf = make_buffer(max_chunks=2)
    insert(buf.client, [buf.fragment(seq=q) for q in range(5)])
    st = stats(buf.client)
    assert (st.chunks, st.dropped_chunks["evicted"], st.capacity_chunks) == (2, 3, 2)
    assert sorted(_sequences(c)[0] for c in sample(buf.client, 2)) == [3, 4]
    wait_until(lambda: buf.blob_keys() == [], what="blobs of evicted and consumed chunks deleted")


def test_max_reuse(make_buffer):
    buf = make_buffer(max_reuse=3)
    insert(buf.client, [buf.fragment(seq=0)])
    got = [c.times_sampled for _ in range(3) for c in sample(buf.client, 1)]
    assert got == [1, 2, 3]
    assert sample(buf.client, 1, timeout=0.2, allow_partial=True) == []
    st = stats(buf.client)
    assert (st.chunks, st.dropped_chunks["reused"], st.sampled_chunks, st.mean_reuse) == (0, 1, 3, 3.0)
    wait_until(lambda: buf.blob_keys() == [], what="blob of a used-up chunk deleted")


def test_one_sample_call_never_returns_a_chunk_twice_when_reuse_is_one(make_buffer):
    buf = make_buffer(max_reuse=1)
    insert(buf.client, [buf.fragment(seq=q) for q in range(6)])
    chunks = sample(buf.client, 6)
    assert sorted(_sequences(c)[0] for c in chunks) == list(range(6))
    assert {c.times_sampled for c in chunks} == {1}


def test_claims_take_the_oldest_chunks_first(make_buffer):
    """By first model version, then arrival: a chunk never waits behind chunks stepped after it, so it
    is sampled before it can go stale. Slots 0-3 step at versions 2, 1, 2, 1; with 12 chunks, ties past
    id 9 check that arrival, not the text of an id, orders them."""
    buf = make_buffer(max_reuse=1, max_staleness=10)
    frags = [buf.fragment(slot=slot, seq=q, version=version)
             for q in range(3) for slot, version in enumerate((2, 1, 2, 1))]
    insert(buf.client, frags)
    order = [(c.fragments[0].header.env_slot, _sequences(c)[0]) for n in (3, 3, 6) for c in sample(buf.client, n)]
    assert order == [(1, 0), (3, 0), (1, 1), (3, 1), (1, 2), (3, 2),
                     (0, 0), (2, 0), (0, 1), (2, 1), (0, 2), (2, 2)]


def test_uniform_order_samples_every_chunk_in_any_order(make_buffer):
    buf = make_buffer(max_reuse=1, sample_order="uniform")
    insert(buf.client, [buf.fragment(seq=q, version=q // 10) for q in range(40)])
    first = [_sequences(c)[0] for c in sample(buf.client, 10)]
    assert first != list(range(10))  # 1 in 40!/30! by chance
    assert sorted(first + [_sequences(c)[0] for c in sample(buf.client, 30)]) == list(range(40))


def test_staleness_on_arrival_and_on_version_moves(make_buffer):
    buf = make_buffer(max_staleness=1, fragments_per_chunk=1)
    assert buf.client.set_model_version(3).dropped_chunks == 0
    acks = insert(buf.client, [buf.fragment(seq=0, version=1), buf.fragment(seq=1, version=2),
                             buf.fragment(seq=2, version=3)])
    assert [a.stored for a in acks] == [False, True, True]  # 1 < 3 - 1: stale on arrival, acked as not stored
    st = stats(buf.client)
    assert (st.chunks, st.dropped_chunks["stale_on_arrival"], st.max_staleness, st.mean_staleness) == (2, 1, 1, 0.5)
    moved = buf.client.set_model_version(4)
    assert moved.dropped_chunks == 1
    st = stats(buf.client)
    assert (st.chunks, st.dropped_chunks["stale"], st.model_version) == (1, 1, 4)  # went stale waiting
    with pytest.raises(grpc.RpcError) as err:
        buf.client.set_model_version(2)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    wait_until(lambda: len(buf.blob_keys()) == 1, what="stale blobs deleted")


def test_stale_when_the_chunk_completes(make_buffer):
    buf = make_buffer(max_staleness=0, fragments_per_chunk=2)
    insert(buf.client, [buf.fragment(seq=0, version=0)])
    buf.client.set_model_version(1)
    acks = insert(buf.client, [buf.fragment(seq=1, version=1)])
    assert [a.stored for a in acks] == [False]
    st = stats(buf.client)
    assert (st.chunks, st.fragments, st.dropped_chunks["stale_on_arrival"]) == (0, 0, 1)


def test_resent_fragment_is_acknowledged_once_stored_once(make_buffer):
    """Workers resend unacknowledged fragments after a reconnect: delivery is at least once, storage once."""
    buf = make_buffer(fragments_per_chunk=2)
    frags = [buf.fragment(seq=q) for q in range(4)]
    insert(buf.client, frags[:3])
    acks = insert(buf.client, frags[1:])  # 1 and 2 again, then 3
    assert [(a.sequence, a.stored) for a in acks] == [(1, True), (2, True), (3, True)]
    st = stats(buf.client)
    assert (st.chunks, st.fragments, st.inserted_fragments) == (2, 4, 4)
    assert "incomplete" not in st.dropped_chunks
    wait_until(lambda: len(buf.blob_keys()) == 4, what="duplicate blobs deleted")


def test_sample_deadline_and_allow_partial(make_buffer):
    buf = make_buffer(max_reuse=1)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        sample(buf.client, 2, timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "only 0 of 2 chunks after 0.3s" in err.value.details()
    assert "0 chunks in the buffer" in err.value.details()
    assert 0.25 < time.monotonic() - started < 5
    insert(buf.client, [buf.fragment(seq=0)])
    started = time.monotonic()
    got = sample(buf.client, 3, timeout=0.3, allow_partial=True)
    assert len(got) == 1 and time.monotonic() - started >= 0.25
    with pytest.raises(grpc.RpcError) as err:
        sample(buf.client, 0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf"), 1e300, 86400.0 + 1])
def test_a_sample_timeout_that_is_no_duration_is_refused(make_buffer, timeout):
    """A deadline must be a finite, non-negative number of seconds no longer than a day (a huge one
    overflowed the wait and answered UNKNOWN)."""
    buf = make_buffer()
    insert(buf.client, [buf.fragment(seq=0)])
    request = replay_buffer_pb2.SampleRequest(num_chunks=1, timeout_seconds=timeout, reader_id="test")
    with pytest.raises(grpc.RpcError) as err:
        list(buf.client.call("Sample", request, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_seconds" in err.value.details()


def test_sample_waits_for_data_that_arrives(make_buffer):
    buf = make_buffer()
    result: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: result.put(sample(buf.client, 2, timeout=10)))
    reader.start()
    time.sleep(0.2)
    insert(buf.client, [buf.fragment(seq=0), buf.fragment(seq=1)])
    reader.join(10)
    assert len(result.get(timeout=1)) == 2


@pytest.mark.parametrize("bad", ["shape", "dtype", "nan", "oversized", "run", "length", "decode"])
def test_invalid_fragment_is_rejected_counted_and_the_service_stays_up(make_buffer, bad):
    buf = make_buffer(max_fragment_bytes=200_000)
    base = fragment_data(buf.spaces, buf.fragment_length, seed=1)
    if bad == "shape":
        base["obs.rgb"] = np.zeros((buf.fragment_length, 4, 5, 3), np.uint8)
        frag = make_fragment(buf.run_id, seq=1, data=base)
    elif bad == "dtype":
        base["reward"] = base["reward"].astype(np.float64)
        frag = make_fragment(buf.run_id, seq=1, data=base)
    elif bad == "nan":
        base["value"][3] = np.nan
        frag = make_fragment(buf.run_id, seq=1, data=base)
    elif bad == "oversized":
        base["junk"] = np.zeros(buf.rb.max_fragment_bytes + 1, np.uint8)
        frag = make_fragment(buf.run_id, seq=1, data=base)
    elif bad == "run":
        frag = make_fragment("another-run", seq=1)
    elif bad == "length":
        frag = make_fragment(buf.run_id, seq=1, length=buf.fragment_length + 1)
    else:
        frag = buf.fragment(seq=1)
        frag.tensors = b"\x00" * 64
    acks, err = insert_until_error(buf.client, [buf.fragment(seq=0), frag, buf.fragment(seq=2)])
    assert [a.sequence for a in acks] == [0]  # the good one before is acknowledged, nothing after
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    expected_reason = {"shape": "spec", "dtype": "spec"}.get(bad, bad)
    assert f"fragment rejected ({expected_reason})" in err.details()
    st = stats(buf.client)
    assert st.rejected_fragments[expected_reason] >= 1
    assert st.fragments == 1
    # Still serving: the next stream goes through.
    assert [a.stored for a in insert(buf.client, [buf.fragment(seq=2)])] == [True]
    assert stats(buf.client).fragments == 2


def test_rate_limiter_validation_rejects_deadlocking_settings():
    with pytest.raises(ValueError, match="block each other forever"):
        RateLimiter.create(2.0, 1.0, 1, max_reuse=4)  # band narrower than one sample/insert step
    with pytest.raises(ValueError, match="max_reuse"):
        RateLimiter.create(3.0, 3.0, 1, max_reuse=2)  # asks more samples per chunk than allowed
    with pytest.raises(ValueError, match="> 0"):
        RateLimiter.create(0.0, 1.0, 1, max_reuse=2)
    assert RateLimiter.create(None, 0.0, 1, max_reuse=2) is None
    with pytest.raises(ConfigError, match="samples_per_insert"):
        load_config({"rollout_config": {"replay_buffer_config": {"samples_per_insert": 2.0,
                                                                 "samples_per_insert_error": 0.5,
                                                                 "max_reuse": 4}}})


def test_rate_limiter_blocks_inserts_until_samples(make_buffer):
    # spi 1, error 1, min size 1: at most two unsampled chunks ahead.
    buf = make_buffer(samples_per_insert=1.0, samples_per_insert_error=1.0, min_size_to_sample=1, max_reuse=1)
    feed: queue.Queue = queue.Queue()
    acks: queue.Queue = queue.Queue()

    def gen():
        while (item := feed.get()) is not None:
            yield replay_buffer_pb2.InsertRequest(fragment=item)

    def consume():
        for ack in buf.client.insert(gen(), timeout=30):
            acks.put(ack.sequence)

    t = threading.Thread(target=consume)
    t.start()
    try:
        for q in range(3):
            feed.put(buf.fragment(seq=q))
        assert [acks.get(timeout=5) for _ in range(2)] == [0, 1]
        with pytest.raises(queue.Empty):
            acks.get(timeout=0.4)  # the third waits: backpressure, not a drop
        assert len(sample(buf.client, 1)) == 1
        assert acks.get(timeout=5) == 2
        # Two chunks held, two samples owed: both can be drawn, then the band stops the sampler too.
        assert len(sample(buf.client, 3, timeout=0.3, allow_partial=True)) == 2
        feed.put(buf.fragment(seq=3))
        assert acks.get(timeout=5) == 3
    finally:
        feed.put(None)
        t.join(10)
    assert "rate limiter" in buf.front.index.describe_wait()


def test_rate_limiter_limits_samples_of_a_reusable_chunk(make_buffer):
    # spi 1: one insert pays for one sample, even though max_reuse would allow a second one.
    buf = make_buffer(samples_per_insert=1.0, samples_per_insert_error=1.0, max_reuse=2)
    insert(buf.client, [buf.fragment(seq=0)])
    assert [c.times_sampled for c in sample(buf.client, 2, timeout=0.3, allow_partial=True)] == [1]
    insert(buf.client, [buf.fragment(seq=1)])
    assert len(sample(buf.client, 2, timeout=0.3, allow_partial=True)) == 1


def test_rate_limiter_credits_dropped_chunks(make_buffer):
    # One chunk fits: every insert evicts the previous unsampled chunk, whose samples are credited,
    # so inserts never deadlock although nobody samples.
    buf = make_buffer(samples_per_insert=1.0, samples_per_insert_error=1.0, max_chunks=1, max_reuse=1)
    acks = insert(buf.client, [buf.fragment(seq=q) for q in range(6)], timeout=10)
    assert len(acks) == 6
    assert stats(buf.client).dropped_chunks["evicted"] == 5


def test_sample_deadline_message_names_the_rate_limiter(make_buffer):
    buf = make_buffer(samples_per_insert=1.0, samples_per_insert_error=1.0, min_size_to_sample=3, max_reuse=1)
    insert(buf.client, [buf.fragment(seq=0)])
    with pytest.raises(grpc.RpcError) as err:
        sample(buf.client, 1, timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "rate limiter" in err.value.details() and "1 chunks in the buffer" in err.value.details()


def test_insert_stream_with_many_fragments_keeps_order(make_buffer):
    buf = make_buffer(fragments_per_chunk=4, max_chunks=1000, service={"ingest_window": 3})
    frags = [buf.fragment(slot=s, seq=q) for q in range(8) for s in range(3)]
    acks = list(buf.client.insert(requests(frags), timeout=30))
    assert [(a.env_slot, a.sequence) for a in acks] == [(f.header.env_slot, f.header.sequence) for f in frags]
    st = stats(buf.client)
    assert (st.chunks, st.fragments) == (6, 24) and "incomplete" not in st.dropped_chunks


def test_generated_registration_behaves_the_same(make_buffer):
    """`overworld serve` may register the service with the generated code (parsed messages)."""
    buf = make_buffer(fronts=0, fragments_per_chunk=2)
    generated = buf.add_front(generated=True)
    fast = buf.add_front()
    frags = [buf.fragment(seq=q) for q in range(4)]
    assert [a.stored for a in insert(generated.client, frags[:2])] == [True, True]
    assert [a.stored for a in insert(fast.client, frags[2:])] == [True, True]
    for front in (generated, fast):
        (chunk,) = sample(front.client, 1)
        assert list(chunk.fragments) == frags[2 * (chunk.fragments[0].header.sequence // 2):][:2]
    bad = fragment_data(buf.spaces, buf.fragment_length)
    bad["reward"][0] = np.inf
    _, err = insert_until_error(generated.client, [make_fragment(buf.run_id, seq=9, data=bad)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "(nan)" in err.details()


def test_compressed_fragments_are_accepted(make_buffer):
    from overworld.core.wire.fragment import Fragment
    from overworld.v1 import common_pb2

    buf = make_buffer()
    frag = Fragment(buf.run_id, "w1", 0, 0, fragment_data(buf.spaces, buf.fragment_length)).to_proto(
        common_pb2.COMPRESSION_ZLIB)
    assert [a.stored for a in insert(buf.client, [frag])] == [True]
    assert list(sample(buf.client, 1)[0].fragments) == [frag]
