"""Graceful shutdown: in-flight streams end with UNAVAILABLE (clients retry elsewhere), nothing acknowledged is lost."""

from __future__ import annotations

import queue
import threading
import time

import grpc
from rb_support import insert, sample, stats

from overworld.v1 import replay_buffer_pb2


def test_stop_ends_streams_with_unavailable_and_keeps_acknowledged_data(make_buffer):
    buf = make_buffer(fronts=2, samples_per_insert=1.0, samples_per_insert_error=1.0, max_reuse=1)
    feed: queue.Queue = queue.Queue()
    acks: list[int] = []
    errors: list[grpc.RpcError] = []

    def gen():
        while (item := feed.get()) is not None:
            yield replay_buffer_pb2.InsertRequest(fragment=item)

    def consume():
        try:
            for ack in buf.fronts[1].client.insert(gen(), timeout=30):
                acks.append(ack.sequence)
        except grpc.RpcError as err:
            errors.append(err)

    t = threading.Thread(target=consume)
    t.start()
    for q in range(3):  # the third is blocked by the rate limiter when the front stops
        feed.put(buf.fragment(seq=q))
    reader_result: queue.Queue = queue.Queue()
    empty = make_buffer()  # a reader waiting on a front that stops
    waiting = threading.Thread(target=lambda: reader_result.put(_sample_error(empty)))
    waiting.start()
    deadline = time.monotonic() + 10
    while len(acks) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    buf.fronts[1].service.stop()  # what SIGTERM does first (then the gRPC server stops)
    empty.front.service.stop()
    feed.put(None)
    t.join(10)
    waiting.join(10)
    assert acks == [0, 1]
    assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
    assert reader_result.get(timeout=1) == grpc.StatusCode.UNAVAILABLE
    # The other front serves everything acknowledged.
    assert stats(buf.client).chunks == 2
    assert len(sample(buf.client, 2)) == 2
    assert [a.stored for a in insert(buf.client, [buf.fragment(seq=2)])] == [True]


def _sample_error(buf):
    try:
        sample(buf.client, 1, timeout=20)
    except grpc.RpcError as err:
        return err.code()
    return None
