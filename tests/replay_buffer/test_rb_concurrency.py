"""Several fronts and several readers at once: max_reuse and the rate limiter hold exactly."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import grpc
from rb_support import insert, sample, stats

FRAGMENTS_PER_WRITER = 30


def _run(buf, writers_per_front: int = 1, readers_per_front: int = 2):
    """Two writers (one per front) and four readers (two per front); returns every sampled (chunk, times)."""
    total = FRAGMENTS_PER_WRITER * writers_per_front * len(buf.fronts)
    seen: list[tuple[int, int, tuple]] = []
    lock = threading.Lock()
    writing = threading.Event()
    writing.set()
    errors: list[BaseException] = []

    def write(front, worker: str):
        try:
            # Interleave two env slots so that fronts race on the same index structures.
            frags = [buf.fragment(worker=worker, slot=q % 2, seq=q // 2) for q in range(FRAGMENTS_PER_WRITER)]
            for start in range(0, len(frags), 5):
                insert(front.client, frags[start:start + 5])
        except BaseException as err:
            errors.append(err)

    def read(front, reader: str):
        try:
            while True:
                got = sample(front.client, 3, timeout=0.2, allow_partial=True, reader=reader)
                with lock:
                    for c in got:
                        first = c.fragments[0].header
                        seen.append((c.chunk_id, c.times_sampled, (first.worker_id, first.env_slot, first.sequence)))
                if not got and not writing.is_set() and stats(front.client).chunks == 0:
                    return
        except BaseException as err:
            errors.append(err)

    writers = [threading.Thread(target=write, args=(f, f"w{i}-{j}")) for i, f in enumerate(buf.fronts)
               for j in range(writers_per_front)]
    readers = [threading.Thread(target=read, args=(f, f"r{i}-{j}")) for i, f in enumerate(buf.fronts)
               for j in range(readers_per_front)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(60)
    writing.clear()
    for t in readers:
        t.join(60)
    assert not errors, errors
    return seen, total


def test_two_fronts_four_readers_never_exceed_max_reuse(make_buffer):
    max_reuse = 3
    buf = make_buffer(fronts=2, max_reuse=max_reuse, max_chunks=1000)
    seen, total = _run(buf)
    by_chunk: dict[int, list[int]] = defaultdict(list)
    payload: dict[int, tuple] = {}
    for chunk_id, times, first in seen:
        by_chunk[chunk_id].append(times)
        assert payload.setdefault(chunk_id, first) == first  # a chunk id always names the same data
    assert len(by_chunk) == total  # every chunk was sampled...
    for chunk_id, times in by_chunk.items():
        # ...exactly max_reuse times, each claim with its own count: no lost update, no overshoot.
        assert sorted(times) == list(range(1, max_reuse + 1)), (chunk_id, times)
    st = stats(buf.client)
    assert (st.chunks, st.sampled_chunks, st.dropped_chunks["reused"]) == (0, total * max_reuse, total)
    assert st.mean_reuse == max_reuse


def test_rate_limiter_holds_across_fronts(make_buffer):
    # spi 1 with an error band of 2: across both fronts, inserts never run more than ~3 chunks ahead
    # of samples, and neither side deadlocks.
    buf = make_buffer(fronts=2, samples_per_insert=1.0, samples_per_insert_error=2.0, max_reuse=1, max_chunks=1000)
    worst = [0]
    done = threading.Event()

    def watch():
        index = buf.front.index
        while not done.is_set():
            s = index.stats()
            worst[0] = max(worst[0], s.chunks)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        seen, total = _run(buf)
    finally:
        done.set()
        watcher.join()
    assert len(seen) == total
    # diff = inserts - samples <= offset + error = 1 + 2: at most 3 unsampled chunks are ever held.
    assert worst[0] <= 3, worst[0]


def test_concurrent_version_moves_and_inserts(make_buffer):
    buf = make_buffer(fronts=2, max_staleness=0, max_chunks=1000)
    errors = []

    def bump(front):
        for v in range(1, 20):
            try:
                front.client.set_model_version(v)
            except grpc.RpcError as err:  # the other front moved further already: refused, never applied
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    errors.append(err)

    threads = [threading.Thread(target=bump, args=(f,)) for f in buf.fronts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    st = stats(buf.client)
    assert st.model_version == 19
    acks = insert(buf.client, [buf.fragment(seq=0, version=18), buf.fragment(seq=1, version=19)])
    assert [a.stored for a in acks] == [False, True]
