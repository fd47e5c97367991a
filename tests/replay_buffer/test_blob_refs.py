"""Sampling by reference (SampleRequest.blob_refs): the front claims, the reader fetches the blobs from
the store itself. Over real gRPC, once per backend (memory + local directory, Redis + S3)."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY
from rb_support import insert, sample, stats, wait_until

from overworld.core.blobs.urls import open_blob_store
from overworld.core.grpc_util import serve
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.replay_buffer.sweeper import OrphanSweeper
from overworld.v1 import common_pb2, replay_buffer_pb2, replay_buffer_pb2_grpc


@pytest.fixture(autouse=True)
def reader_env(backend, monkeypatch):
    """Readers take the S3 endpoint and credentials from OVERWORLD_S3_*, like every other service."""
    for key, value in backend.s3.items():
        monkeypatch.setenv(key, value)


def _refs(client, n: int, timeout: float = 2.0, allow_partial: bool = False) -> list[replay_buffer_pb2.SampledChunk]:
    """One Sample call by reference, as sent: the front's own answer."""
    request = replay_buffer_pb2.SampleRequest(num_chunks=n, timeout_seconds=timeout, allow_partial=allow_partial,
                                              blob_refs=True)
    return list(client.call("Sample", request, timeout=timeout + 30))


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _fragments(chunk: replay_buffer_pb2.SampledChunk) -> list[bytes]:
    return [f.SerializeToString() for f in chunk.fragments]


def _sample_until_stopped(address: str, n: int, seconds: float, **kwargs) -> list[replay_buffer_pb2.SampledChunk]:
    """A reader of its own (a fresh choice of store) sampling until `seconds` have passed."""
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    try:
        with ReplayBufferClient(address) as reader:
            return reader.sample(n, "test", wait=0.3, stop=stop, **kwargs)
    finally:
        timer.cancel()


def test_refs_name_blobs_in_the_store_the_front_describes(make_buffer, backend):
    buf = make_buffer(fragments_per_chunk=2, service={"ref_grace": 7.5})
    insert(buf.client, [buf.fragment(seq=q) for q in range(4)])
    info = buf.client.store_info()
    assert info.blob_store_url == buf.front.blobs.url and info.ref_grace_seconds == 7.5
    assert info.blob_store_url == (f"s3://overworld-test/{buf.run_id}" if backend.name == "redis"
                                   else str(Path(backend.workdir / buf.run_id).resolve()))
    before = _metric("overworld_replay_buffer_ref_samples_total")
    chunks = _refs(buf.client, 2)
    assert len(chunks) == 2 and {c.chunk_id for c in chunks} == {1, 2}
    store = open_blob_store(info.blob_store_url)  # what a reader opens: no credentials in the URL
    for c in chunks:
        assert not c.fragments and len(c.blob_keys) == 2 and c.times_sampled == 1
        frags = [common_pb2.Fragment.FromString(store.get(k)) for k in c.blob_keys]
        assert [f.header.sequence for f in frags] in ([0, 1], [2, 3])  # consecutive, in order
    assert _metric("overworld_replay_buffer_ref_samples_total") - before == 4
    # The generated registration serves the same (GetStoreInfo and blob_refs included).
    plain = buf.add_front(generated=True)
    assert plain.client.store_info().blob_store_url == info.blob_store_url


def test_reader_by_refs_gets_the_same_bytes_and_reuse_counts_the_same(make_buffer):
    buf = make_buffer(max_reuse=2, max_chunks=10, fragments_per_chunk=2)
    insert(buf.client, [buf.fragment(seq=q) for q in range(8)])
    # One claim each (4 <= the front's prefetch): every chunk once in-band, then every chunk again by ref.
    in_band = {c.chunk_id: c for c in sample(buf.client, 4)}
    with ReplayBufferClient(buf.front.address) as reader:
        by_ref = {c.chunk_id: c for c in reader.sample(4, "refs", wait=2.0, blob_refs=True)}
    assert set(in_band) == set(by_ref) == {1, 2, 3, 4}
    for chunk_id, c in by_ref.items():
        assert not c.blob_keys and len(c.fragments) == 2
        assert _fragments(c) == _fragments(in_band[chunk_id])
        assert (in_band[chunk_id].times_sampled, c.times_sampled) == (1, 2)
    st = stats(buf.client)
    assert st.chunks == 0 and st.sampled_chunks == 8 and st.dropped_chunks["reused"] == 4 and st.mean_reuse == 2.0
    with pytest.raises(grpc.RpcError) as err:  # max_reuse holds: nothing left to claim
        _refs(buf.client, 1, timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_reader_samples_by_refs_by_default_when_the_store_is_s3(make_buffer, backend):
    buf = make_buffer(max_chunks=10)
    insert(buf.client, [buf.fragment(seq=q) for q in range(4)])
    before = _metric("overworld_replay_buffer_ref_samples_total")
    with ReplayBufferClient(buf.front.address) as client:
        reader = client.reader(chunks_per_batch=4, num_readers=2, prefetch_batches=0, name="t", wait=2.0)
        try:
            batch = reader.next()
        finally:
            reader.close()
    assert sorted(c.fragments[0].header.sequence for c in batch) == [0, 1, 2, 3]
    assert all(isinstance(c, replay_buffer_pb2.SampledChunk) and not c.blob_keys for c in batch)
    by_ref = _metric("overworld_replay_buffer_ref_samples_total") - before
    assert by_ref == (4 if backend.name == "redis" else 0)  # a local directory stays in-band by default


def test_two_fronts_four_ref_readers_never_exceed_max_reuse(make_buffer):
    # The service's ref grace (the suite's default of 0 gives a reader by ref only delete_delay, 0.1 s, to
    # fetch a chunk's blob once its last claim is made: a loaded machine missed that and lost two claims).
    buf = make_buffer(fronts=2, max_reuse=3, max_chunks=50, service={"ref_grace": 60.0})
    for i, front in enumerate(buf.fronts):
        insert(front.client, [buf.fragment(worker=f"w{i}", seq=q) for q in range(6)])
    got: list[replay_buffer_pb2.SampledChunk] = []
    lock = threading.Lock()
    stop = threading.Event()

    def read(front):
        with ReplayBufferClient(front.address) as reader:
            while not stop.is_set():
                # Calls long enough that a loaded machine never cancels one between the front's claim and its
                # answer: a claimed chunk that is never sent counts as sampled (by design) and would be missing.
                chunks = reader.sample(2, "r", wait=2.0, stop=stop, blob_refs=True)
                with lock:
                    got.extend(chunks)

    threads = [threading.Thread(target=read, args=(f,)) for f in buf.fronts for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: stats(buf.client).chunks == 0, 60, "every chunk used up")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    times: dict[int, list[int]] = defaultdict(list)
    for c in got:
        times[c.chunk_id].append(c.times_sampled)
        assert len(c.fragments) == 1
    assert len(times) == 12 and all(sorted(t) == [1, 2, 3] for t in times.values())
    st = stats(buf.client)
    assert st.chunks == 0 and st.sampled_chunks == 36 and st.dropped_chunks["reused"] == 12


def test_a_chunk_whose_blob_is_gone_is_skipped_and_counted(make_buffer, caplog):
    buf = make_buffer(max_chunks=10)
    insert(buf.client, [buf.fragment(seq=q) for q in range(3)])
    (gone,) = [k for k in buf.blob_keys() if "/000000000001-" in k]
    buf.front.blobs.delete([gone])  # as if it had been deleted after the grace period
    before = _metric("overworld_replay_buffer_reader_skipped_chunks_total", reason="missing")
    chunks = _sample_until_stopped(buf.front.address, 3, 2.0, blob_refs=True)
    assert sorted(c.fragments[0].header.sequence for c in chunks) == [0, 2]
    assert _metric("overworld_replay_buffer_reader_skipped_chunks_total", reason="missing") - before == 1
    assert "is gone" in caplog.text
    assert stats(buf.client).sampled_chunks == 3  # the claim counted; the reader asked for another in its place


def test_blobs_of_a_chunk_claimed_by_ref_outlive_the_grace_only(make_buffer):
    grace = 6.0  # the checks "still there" run well within it on a loaded machine
    buf = make_buffer(max_chunks=10, service={"ref_grace": grace, "delete_delay": 0.05})
    insert(buf.client, [buf.fragment(seq=q) for q in range(2)])
    claimed = time.monotonic()
    (ref,) = _refs(buf.client, 1)  # max_reuse 1: the chunk leaves the index with this claim
    (key,) = ref.blob_keys
    store = open_blob_store(buf.client.store_info().blob_store_url)
    assert store.get(key)  # still there well within the grace: the reader's fetch works
    wait_until(lambda: key not in buf.blob_keys(), grace + 10, "the blob deleted after the grace")
    assert time.monotonic() - claimed >= grace
    assert len(buf.blob_keys()) == 1  # the other chunk's blob is untouched
    # A reader that comes back after the grace finds the blob gone: skipped and counted, no crash.
    before = _metric("overworld_replay_buffer_reader_skipped_chunks_total", reason="missing")
    with ReplayBufferClient(buf.front.address) as late:
        assert late.blob_refs.fetch(store, "late", [ref]) == []
    assert _metric("overworld_replay_buffer_reader_skipped_chunks_total", reason="missing") - before == 1


def test_another_fronts_eviction_keeps_blobs_handed_out_by_ref_for_the_grace(make_buffer):
    grace = 6.0  # the checks "still there" run well within it on a loaded machine
    buf = make_buffer(fronts=2, max_chunks=2, max_reuse=5, service={"ref_grace": grace, "delete_delay": 0.05})
    a, b = buf.fronts
    insert(b.client, [buf.fragment(seq=q) for q in range(2)])
    claimed = time.monotonic()
    refs = _refs(a.client, 2)  # not final (max_reuse 5): the chunks stay in the index
    keys = [k for ref in refs for k in ref.blob_keys]
    assert b.index.ref_claim_age() is not None
    insert(b.client, [buf.fragment(seq=q) for q in range(2, 4)])  # front b evicts both claimed chunks
    assert stats(b.client).dropped_chunks["evicted"] == 2
    time.sleep(0.5)  # far past delete_delay: front b knows of the claim by reference through the index
    assert set(keys) <= set(buf.blob_keys())
    wait_until(lambda: not set(keys) & set(buf.blob_keys()), grace + 10, "the evicted blobs deleted")
    assert time.monotonic() - claimed >= grace


def test_without_claims_by_ref_blobs_go_after_the_short_delay(make_buffer):
    buf = make_buffer(max_chunks=10, service={"ref_grace": 60.0, "delete_delay": 0.05})
    insert(buf.client, [buf.fragment(seq=q) for q in range(2)])
    assert buf.front.index.ref_claim_age() is None
    (chunk,) = sample(buf.client, 1)  # in-band: the front read the blob before sending it
    wait_until(lambda: len(buf.blob_keys()) == 1, 10, "the used-up chunk's blob deleted")
    assert buf.front.index.ref_claim_age() is None


def test_the_sweeper_spares_blobs_of_a_recent_claim_for_the_grace(make_buffer):
    buf = make_buffer(max_chunks=10, service={"ref_grace": 60.0, "orphan_grace": 0.0})
    insert(buf.client, [buf.fragment(seq=0)])
    (ref,) = _refs(buf.client, 1)  # the chunk left the index; its (old enough) blob is unreferenced
    (key,) = ref.blob_keys
    now = time.time() + 1
    sweeper = buf.front.service.sweeper
    assert sweeper.sweep(now) == []  # first seen unreferenced: a reader may be fetching it
    assert sweeper.sweep(now + 59) == []
    assert key in buf.blob_keys()
    assert sweeper.sweep(now + 61) == [key]  # unreferenced for the whole grace: an orphan
    assert key not in buf.blob_keys()
    # Without the ref grace (the old behaviour) the blob would have been swept at once.
    insert(buf.client, [buf.fragment(seq=1)])
    (ref,) = _refs(buf.client, 1)
    later = time.time() + 1
    assert OrphanSweeper(buf.front.index, buf.front.blobs, sweeper.prefix, 0.0).sweep(later) == list(ref.blob_keys)


def test_a_stopped_front_leaves_blobs_in_their_grace_to_the_sweeper(make_buffer):
    buf = make_buffer(max_chunks=10, service={"ref_grace": 60.0})
    insert(buf.client, [buf.fragment(seq=0)])
    (ref,) = _refs(buf.client, 1)
    buf.front.service.stop()
    assert list(ref.blob_keys) == buf.blob_keys()  # a reader handed the keys can still fetch them


def test_reader_falls_back_to_in_band_when_it_cannot_use_the_store(make_buffer, backend, monkeypatch, caplog):
    buf = make_buffer(max_chunks=10)
    insert(buf.client, [buf.fragment(seq=q) for q in range(4)])
    if backend.name == "redis":  # no S3 endpoint here: the reader cannot open the store
        monkeypatch.delenv("OVERWORLD_S3_ENDPOINT")
        with ReplayBufferClient(buf.front.address) as no_s3:
            (chunk,) = no_s3.sample(1, "no-s3", wait=2.0)
        assert len(chunk.fragments) == 1
        assert "sampling in-band" in caplog.text
        other = make_buffer(max_chunks=10)  # another client: asks again
        monkeypatch.setenv("OVERWORLD_S3_ENDPOINT", backend.s3["OVERWORLD_S3_ENDPOINT"])
        insert(other.client, [other.fragment(seq=0)])
        reader = ReplayBufferClient(other.front.address)
        assert len(reader.sample(1, "s3", wait=2.0)[0].fragments) == 1
        buf_for_failure = other
    else:
        reader, buf_for_failure = ReplayBufferClient(buf.front.address), buf
        assert len(reader.sample(1, "local", wait=2.0, blob_refs=True)[0].fragments) == 1

    class Failing:
        def get(self, key):
            raise OSError("S3 is down")

    # The store fails: the claimed chunks are skipped and counted, and the reader samples in-band for a while.
    insert(buf_for_failure.client, [buf_for_failure.fragment(seq=q) for q in range(10, 14)])
    reader.blob_refs._choice.store = Failing()
    before = _metric("overworld_replay_buffer_reader_skipped_chunks_total", reason="error")
    chunks = reader.sample(2, "failing", wait=2.0, blob_refs=True)
    assert len(chunks) == 2 and all(len(c.fragments) == 1 for c in chunks)
    assert _metric("overworld_replay_buffer_reader_skipped_chunks_total", reason="error") - before == 2  # both of one claim
    assert reader.blob_refs.store_for(True) is None  # in-band until REF_RETRY_SECONDS passed
    reader.close()


def test_a_store_that_is_not_the_fronts_sends_the_reader_back_in_band(make_buffer, backend, caplog):
    buf = make_buffer(max_chunks=10)
    insert(buf.client, [buf.fragment(seq=q) for q in range(4)])
    reader = ReplayBufferClient(buf.front.address)
    assert reader.blob_refs.store_for(True) is not None
    # As if this reader's OVERWORLD_S3_ENDPOINT named another server with the same bucket: nothing is there.
    elsewhere = backend.blobs(f"{buf.run_id}-elsewhere")
    reader.blob_refs._choice.store = elsewhere
    before = _metric("overworld_replay_buffer_reader_skipped_chunks_total", reason="missing")
    chunks = reader.sample(2, "misconfigured", wait=2.0, blob_refs=True)
    assert len(chunks) == 2 and all(len(c.fragments) == 1 for c in chunks)  # in-band after the first call
    assert _metric("overworld_replay_buffer_reader_skipped_chunks_total", reason="missing") - before == 2
    assert "none of the 2 sampled chunks' blobs were in" in caplog.text
    assert reader.blob_refs.store_for(True) is None
    reader.close()


def test_a_front_without_blob_refs_is_sampled_in_band(make_buffer):
    buf = make_buffer(max_chunks=10)
    insert(buf.client, [buf.fragment(seq=q) for q in range(2)])

    class OldFront(replay_buffer_pb2_grpc.ReplayBufferServicer):  # a release from before GetStoreInfo
        def Sample(self, request, context):
            yield from buf.client.call("Sample", request, timeout=30)

    old_front = serve([(replay_buffer_pb2_grpc.add_ReplayBufferServicer_to_server, OldFront(),
                        "overworld.v1.ReplayBuffer")])
    try:
        with ReplayBufferClient(old_front.address) as old:
            assert old.blob_refs.store_for(True) is None  # GetStoreInfo: UNIMPLEMENTED
            chunks = old.sample(2, "old", wait=2.0, blob_refs=True)
    finally:
        old_front.stop(0)
    assert Counter(len(c.fragments) for c in chunks) == {1: 2}
