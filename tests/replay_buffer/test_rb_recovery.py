"""Restart and recovery: killed fronts, Redis restarts, orphans, run isolation, keep-or-discard on resume."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from rb_support import (
    LENGTH,
    SPACES,
    free_port,
    insert,
    insert_until_error,
    make_fragment,
    new_run_id,
    sample,
    start_front_process,
    stats,
    wait_until,
)

from overworld.core.config import RunConfig
from overworld.core.grpc_util import serve, wait_healthy
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.replay_buffer.index import SWEPT, FragmentMeta
from overworld.replay_buffer.server import fragments_prefix
from overworld.replay_buffer.sweeper import OrphanSweeper
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_manager.server import RolloutManagerService
from overworld.v1 import replay_buffer_pb2, rollout_manager_pb2, rollout_manager_pb2_grpc


def _durable(backend) -> None:
    if not backend.durable:
        pytest.skip("the embedded backend lives and dies with its process")


# ---------------------------------------------------------------------------------------------- kill -9


class Manager:
    """An in-process rollout-manager serving a run config, with the run's spaces declared."""

    def __init__(self, run_id: str, index_url: str, blobs_url: str, fragments_per_chunk: int) -> None:
        config = RunConfig(run_id=run_id)
        config.rollout_config.fragment_length = LENGTH
        rb = config.rollout_config.replay_buffer_config
        rb.max_chunks, rb.max_reuse, rb.fragments_per_chunk = 10_000, 1, fragments_per_chunk
        self.rb = rb
        rb.database_config.index, rb.database_config.blobs = index_url, blobs_url
        self.server = serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server,
                              RolloutManagerService(config), "overworld.v1.RolloutManager")], "127.0.0.1", 0)
        with RolloutManagerClient(self.server.address) as client:
            client.register(rollout_manager_pb2.RegisterRequest(hostname="test", num_envs=2, spaces=SPACES.to_proto()),
                            timeout=10)

    def stop(self) -> None:
        self.server.stop(0.5)


def _start_front(manager: Manager, backend, run_id: str, tmp_path: Path):
    port, metrics_port = free_port(), free_port()
    proc = start_front_process(manager.server.address, backend.index_url, backend.blobs_url(run_id), port,
                               metrics_port, backend.s3, tmp_path / "front.log")
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout=60)
    except TimeoutError:
        proc.kill()
        raise AssertionError((tmp_path / "front.log").read_text()[-3000:]) from None
    return proc, f"127.0.0.1:{port}", metrics_port


def test_kill_9_of_a_front_mid_ingest_loses_no_acknowledged_fragment(backend, tmp_path):
    _durable(backend)
    run_id = new_run_id()
    manager = Manager(run_id, backend.index_url, backend.blobs_url(run_id), fragments_per_chunk=2)
    procs = []
    try:
        proc, address, metrics_port = _start_front(manager, backend, run_id, tmp_path)
        procs.append(proc)
        sent: list = []
        acked: set[tuple[int, int]] = set()
        enough = threading.Event()

        def produce():
            for q in range(10_000):
                frag = make_fragment(run_id, worker="wk", slot=q % 2, seq=q // 2)
                sent.append(frag)
                yield replay_buffer_pb2.InsertRequest(fragment=frag)
                time.sleep(0.003)

        def stream():
            with ReplayBufferClient(address) as client:
                try:
                    for ack in client.insert(produce(), timeout=60):
                        assert ack.stored
                        acked.add((ack.env_slot, ack.sequence))
                        if len(acked) >= 40:
                            enough.set()
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err
                    return
            raise AssertionError("the stream outlived the front")

        writer = threading.Thread(target=stream)
        writer.start()
        assert enough.wait(60), (tmp_path / "front.log").read_text()[-3000:]
        # The process exposes its metrics while it works.
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "overworld_replay_buffer_inserts_total" in body and "overworld_replay_buffer_ingest_latency" in body
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        writer.join(30)
        assert not writer.is_alive()
        acked_now = set(acked)
        assert len(acked_now) >= 40 and len(sent) > len(acked_now)

        # A restarted front serves the same index: everything acknowledged is there.
        proc, address, _ = _start_front(manager, backend, run_id, tmp_path)
        procs.append(proc)
        with ReplayBufferClient(address) as client:
            held = stats(client).fragments
            assert held >= len(acked_now)
            # The worker resends what was never acknowledged; duplicates are recognised.
            unacked = [f for f in sent if (f.header.env_slot, f.header.sequence) not in acked_now]
            acks = insert(client, unacked, timeout=60)
            assert all(a.stored for a in acks) and len(acks) == len(unacked)
            st = stats(client)
            assert st.fragments == len(sent)  # each fragment exactly once

            # No index entry without its blob; the sweeper removes what the kill orphaned.
            index = backend.index(run_id, manager.rb)
            blobs = backend.blobs(run_id)
            OrphanSweeper(index, blobs, fragments_prefix(run_id), grace_seconds=0).sweep()
            live = index.client.smembers(index.prefix + "live")
            assert set(blobs.keys(fragments_prefix(run_id))) == live
            assert len(live) == len(sent)

            chunks = sample(client, st.chunks, timeout=10)
            got = [(f.header.env_slot, f.header.sequence) for c in chunks for f in c.fragments]
            assert len(got) == len(set(got))
            leftover = {(f.header.env_slot, f.header.sequence) for f in sent} - set(got)
            assert len(leftover) <= 2  # at most one incomplete chunk per slot, still held
            assert acked_now <= set(got) | leftover
            index.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        manager.stop()


# ---------------------------------------------------------------------------------------------- Redis restart


def test_redis_restart_with_persistence_keeps_the_index(make_buffer, backend, request):
    _durable(backend)
    redis_server = request.getfixturevalue("redis_server")
    buf = make_buffer(fragments_per_chunk=2, max_reuse=2)
    insert(buf.client, [buf.fragment(seq=q) for q in range(5)])
    sample(buf.client, 1)
    before = stats(buf.client)
    redis_server.stop(kill=True)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stats(buf.client)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        acks, err2 = insert_until_error(buf.client, [buf.fragment(seq=5)])
        assert acks == [] and err2.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        redis_server.start()

    def reachable():
        try:
            stats(buf.client)
            return True
        except grpc.RpcError:
            return False

    wait_until(reachable, 20, "the index back after the Redis restart")
    after = stats(buf.client)
    assert after == before
    # The same front keeps working on the restored index (the resent fragment 5 completes a chunk).
    insert(buf.client, [buf.fragment(seq=5)])
    chunks = sample(buf.client, 3)
    assert sorted(c.times_sampled for c in chunks) == [1, 1, 2]


def test_a_new_front_serves_the_same_index(make_buffer, backend):
    _durable(backend)
    buf = make_buffer(fragments_per_chunk=2, max_reuse=2)
    insert(buf.client, [buf.fragment(seq=q) for q in range(5)])
    before = stats(buf.client)
    buf.front.stop()
    buf.fronts.pop(0)
    front = buf.add_front()
    assert stats(front.client) == before
    insert(front.client, [buf.fragment(seq=5)])  # completes the chunk the old front started
    assert sorted(len(c.fragments) for c in sample(front.client, 3)) == [2, 2, 2]


def test_reuse_and_staleness_stay_exact_across_a_new_front(make_buffer, backend):
    """What a restarted front enforces comes from the index: the model version (staleness) and each
    chunk's times sampled (reuse) are where the last front left them."""
    _durable(backend)
    buf = make_buffer(max_reuse=2, max_staleness=1)
    insert(buf.client, [buf.fragment(seq=q, version=5) for q in range(2)])
    buf.client.set_model_version(6, timeout=10)
    assert sorted(c.times_sampled for c in sample(buf.client, 2)) == [1, 1]
    buf.front.stop()
    buf.fronts.pop(0)
    front = buf.add_front()
    insert(front.client, [buf.fragment(seq=2, version=4)])  # 6 - 1 > 4: stale on arrival at the new front
    assert stats(front.client).dropped_chunks == {"stale_on_arrival": 1}
    assert sorted(c.times_sampled for c in sample(front.client, 2)) == [2, 2]  # the second and last use
    assert stats(front.client).chunks == 0


# ---------------------------------------------------------------------------------------------- isolation, resume


def test_a_new_run_never_sees_another_runs_data(make_buffer):
    a = make_buffer()
    b = make_buffer()
    insert(a.client, [a.fragment(seq=q) for q in range(3)])
    assert stats(b.client).fragments == 0
    assert sample(b.client, 1, timeout=0.2, allow_partial=True) == []
    assert b.blob_keys() == []
    # And a fragment of run a sent to run b's buffer is refused.
    _, err = insert_until_error(b.client, [a.fragment(seq=3)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_discard_on_resume_clears_once_per_attempt(make_buffer):
    buf = make_buffer(fronts=2, fragments_per_chunk=2)
    insert(buf.client, [buf.fragment(seq=q) for q in range(5)])
    buf.client.set_model_version(7)
    assert len(buf.blob_keys()) == 5
    assert buf.front.service.discard_buffered("attempt-2") == 5
    st = stats(buf.client)
    assert (st.fragments, st.chunks, st.model_version, st.inserted_fragments) == (0, 0, 0, 0)
    assert buf.blob_keys() == []
    insert(buf.client, [buf.fragment(worker="w2", seq=0), buf.fragment(worker="w2", seq=1)])
    # The second front starting for the same attempt does not wipe what arrived meanwhile.
    assert buf.fronts[1].service.discard_buffered("attempt-2") == 0
    assert stats(buf.client).chunks == 1
    # keep_on_resume: simply never call it; a later attempt discards again.
    assert buf.fronts[1].service.discard_buffered("attempt-3") == 2
    assert stats(buf.client).fragments == 0


# ---------------------------------------------------------------------------------------------- orphans


def test_sweeper_deletes_orphans_only_and_tombstones_them(make_buffer, backend):
    buf = make_buffer()
    insert(buf.client, [buf.fragment(seq=q) for q in range(3)])
    blobs = buf.front.blobs
    prefix = fragments_prefix(buf.run_id)
    orphan = f"{prefix}w1/0/000000000099-deadbeef"
    blobs.put(orphan, b"half-written")
    other_run = backend.blobs(new_run_id())
    foreign = f"{fragments_prefix('elsewhere')}x"
    other_run.put(foreign, b"another run's")
    sweeper = OrphanSweeper(buf.front.index, blobs, prefix, grace_seconds=3600)
    assert sweeper.sweep() == []  # within the grace period: a front may be about to index it
    assert buf.front.service.sweeper.sweep(now=time.time() + 7200) == [orphan]
    assert orphan not in blobs.keys(prefix) and len(blobs.keys(prefix)) == 3
    assert other_run.keys(fragments_prefix("elsewhere")) == [foreign]
    # A front that stalled past the grace period can no longer index the swept key.
    result = buf.front.index.add(FragmentMeta("w1/0", 99, 0, 12, orphan))
    assert result.status == SWEPT
    assert len(sample(buf.client, 3)) == 3


class SweepsAfterPut:
    """A blob store whose every fragment put is followed by a sweep, as if the front stalled past the grace."""

    def __init__(self, inner, run_id):
        self.inner, self.run_id, self.sweeper, self.swept = inner, run_id, None, 0

    def put(self, key, data):
        self.inner.put(key, data)
        if self.sweeper and self.swept == 0:
            self.swept += len(self.sweeper.sweep(now=time.time() + 7200))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_swept_blob_is_written_again_so_no_entry_lacks_its_blob(make_buffer):
    buf = make_buffer()
    front = buf.front
    wrapped = SweepsAfterPut(front.blobs, buf.run_id)
    front.service.blobs = wrapped
    wrapped.sweeper = OrphanSweeper(front.index, wrapped.inner, fragments_prefix(buf.run_id), 0)
    front.service.sweeper = wrapped.sweeper
    acks = insert(buf.client, [buf.fragment(seq=0)])
    assert wrapped.swept == 1 and acks[0].stored
    (chunk,) = sample(buf.client, 1)
    assert chunk.fragments[0].header.sequence == 0


class FailingPuts:
    def __init__(self, inner):
        self.inner = inner

    def put(self, key, data):
        raise OSError("S3 is down")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_failed_blob_write_is_not_acknowledged_and_not_indexed(make_buffer):
    buf = make_buffer()
    buf.front.service.blobs = FailingPuts(buf.front.blobs)
    acks, err = insert_until_error(buf.client, [buf.fragment(seq=0)])
    assert acks == [] and err.code() == grpc.StatusCode.UNAVAILABLE and "S3 is down" in err.details()
    assert stats(buf.client).fragments == 0


def test_s3_blob_store_from_url(s3_env):
    from overworld.core.blobs.s3 import S3BlobStore

    bucket = f"ow-{new_run_id()}"
    store = S3BlobStore.from_url(f"s3://{bucket}/some/prefix")  # endpoint and keys from OVERWORLD_S3_*
    assert store.client.bucket_exists(bucket)  # created when missing
    store.put("a/b", b"x" * 10)
    store.put("a/c", b"y")
    assert store.get("a/b") == b"x" * 10
    assert store.keys("a/") == ["a/b", "a/c"]
    assert [b.key for b in store.list_blobs()] == ["a/b", "a/c"]
    assert all(b.modified > time.time() - 3600 for b in store.list_blobs())
    store.delete(["a/b", "missing"])
    with pytest.raises(KeyError):
        store.get("a/b")
    assert S3BlobStore.from_url(f"s3://{bucket}/other").keys() == []  # prefixes do not mix
    assert S3BlobStore.from_url(f"s3://{bucket}").keys() == ["some/prefix/a/c"]
    with pytest.raises(ValueError):
        S3BlobStore.from_url("s3:///nobucket")
