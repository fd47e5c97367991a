"""Reserve: workers reserve room before they step a fragment (docs/replay_buffer.md, "Reserving before
stepping"). Reserved room counts against the rate limiter's band as if inserted, the holder's fragments
take it without waiting, unused room goes back (given back, or when its holder goes quiet), and a
buffer without a rate limiter grants everything. Each test runs on both backends, over real sockets."""

from __future__ import annotations

import math
import queue
import threading
import time

import grpc
import pytest
from rb_support import insert, sample, stats

from overworld.replay_buffer.reservations import Reservations
from overworld.v1 import replay_buffer_pb2

LIMITED = {"samples_per_insert": 1.0, "samples_per_insert_error": 1.0, "min_size_to_sample": 1, "max_reuse": 1}


def reserve(client, worker: str, n: int, wait: float = 0.0, give_back: int = 0) -> replay_buffer_pb2.ReserveResponse:
    return client.reserve(worker, n, wait=wait, give_back=give_back, timeout=10)


def test_reserved_room_fills_the_band_and_the_holders_fragments_take_it(make_buffer):
    # spi 1, error 1, min size 1: two chunks may be ahead of the sampler, reserved or inserted.
    buf = make_buffer(**LIMITED)
    reply = reserve(buf.client, "w1", 5)
    assert (reply.granted, reply.limited) == (2, True)
    assert reserve(buf.client, "w2", 1).granted == 0
    assert stats(buf.client).reserved_fragments == 2
    assert "2 reserved" in buf.front.index.describe_wait()
    # w1's fragments take the room it reserved: both acknowledged at once, though the band is full.
    insert(buf.client, [buf.fragment(worker="w1", slot=0, seq=0), buf.fragment(worker="w1", slot=1, seq=0)], timeout=5)
    assert stats(buf.client).reserved_fragments == 0
    # Nothing is left for another worker until the sampler draws: w2 is held back, its insert too.
    assert reserve(buf.client, "w2", 1).granted == 0
    assert len(sample(buf.client, 1)) == 1
    assert reserve(buf.client, "w2", 3).granted == 1


def test_an_unreserved_insert_waits_while_others_hold_the_room(make_buffer):
    buf = make_buffer(**LIMITED)
    assert reserve(buf.client, "w1", 2).granted == 2
    acks: queue.Queue = queue.Queue()
    t = threading.Thread(target=lambda: acks.put(insert(buf.client, [buf.fragment(worker="w2")], timeout=20)))
    t.start()
    with pytest.raises(queue.Empty):
        acks.get(timeout=0.5)  # backpressure: w1 holds the whole band
    reserve(buf.client, "w1", 0, give_back=2)
    assert len(acks.get(timeout=10)) == 1
    t.join(5)


def test_a_reserve_waits_for_room_until_the_sampler_draws(make_buffer):
    buf = make_buffer(**LIMITED)
    insert(buf.client, [buf.fragment(seq=0), buf.fragment(seq=1)])
    replies: queue.Queue = queue.Queue()
    t = threading.Thread(target=lambda: replies.put(reserve(buf.client, "w2", 4, wait=20.0)))
    t.start()
    with pytest.raises(queue.Empty):
        replies.get(timeout=0.5)
    assert len(sample(buf.client, 1)) == 1
    assert replies.get(timeout=10).granted == 1
    t.join(5)
    started = time.monotonic()
    assert reserve(buf.client, "w3", 1, wait=0.3).granted == 0  # no room: answered at the wait's end
    assert time.monotonic() - started >= 0.25


def test_given_back_room_goes_to_another_worker(make_buffer):
    buf = make_buffer(**LIMITED)
    assert reserve(buf.client, "w1", 2).granted == 2
    assert reserve(buf.client, "w2", 2).granted == 0
    assert reserve(buf.client, "w1", 0, give_back=5).granted == 0  # more than it holds: what it holds
    assert reserve(buf.client, "w2", 2).granted == 2


def test_the_room_of_a_quiet_worker_lapses(make_buffer):
    buf = make_buffer(service={"reservation_ttl": 0.5}, **LIMITED)
    assert reserve(buf.client, "w1", 2).granted == 2
    assert reserve(buf.client, "w2", 1).granted == 0
    time.sleep(0.7)
    assert reserve(buf.client, "w2", 2).granted == 2
    s = stats(buf.client)
    assert (s.reserved_fragments, s.expired_reservations) == (2, 2)


def test_a_fragment_of_the_holder_keeps_its_room_alive(make_buffer):
    buf = make_buffer(service={"reservation_ttl": 1.0}, **{**LIMITED, "samples_per_insert_error": 2.0})
    assert reserve(buf.client, "w1", 3).granted == 3
    for seq in range(2):  # each fragment restarts the holder's ttl
        time.sleep(0.6)
        insert(buf.client, [buf.fragment(worker="w1", seq=seq)])
    assert stats(buf.client).expired_reservations == 0
    assert stats(buf.client).reserved_fragments == 1


def test_room_is_shared_by_every_front_of_a_run(make_buffer, backend):
    if backend.name != "redis":
        pytest.skip("several fronts share an index only through Redis")
    buf = make_buffer(fronts=2, **LIMITED)
    a, b = buf.fronts[0].client, buf.fronts[1].client
    assert reserve(a, "w1", 2).granted == 2
    assert reserve(b, "w2", 2).granted == 0  # the other front sees the band full
    insert(b, [buf.fragment(worker="w1", seq=0)], timeout=5)  # room reserved at one front, taken at the other
    assert stats(a).reserved_fragments == 1


def test_without_a_rate_limiter_every_request_is_granted(make_buffer):
    buf = make_buffer(samples_per_insert=None)
    reply = reserve(buf.client, "w1", 1000)
    assert (reply.granted, reply.limited) == (1000, False)
    assert stats(buf.client).reserved_fragments == 0


@pytest.mark.parametrize("request_fields, says", [
    ({"worker_id": "", "fragments": 1}, "worker_id"),
    ({"worker_id": "w" * 300, "fragments": 1}, "worker_id"),
    ({"worker_id": "w1", "fragments": 10**6}, "at most"),
    ({"worker_id": "w1", "fragments": 1, "wait_seconds": math.nan}, "wait_seconds"),
    ({"worker_id": "w1", "fragments": 1, "wait_seconds": 3600}, "wait_seconds"),
])
def test_a_bad_reserve_request_is_refused_with_a_reason(make_buffer, request_fields, says):
    buf = make_buffer(**LIMITED)
    with pytest.raises(grpc.RpcError) as err:
        buf.client.call("Reserve", replay_buffer_pb2.ReserveRequest(**request_fields), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()
    assert reserve(buf.client, "w1", 1).granted == 1  # the service goes on


def test_the_client_keeps_room_for_the_slots_that_wait(make_buffer):
    """Reservations (the worker's side): `want` makes its thread ask; `take` hands out what came."""
    from overworld.replay_buffer.client import ReplayBufferClient

    buf = make_buffer(**{**LIMITED, "samples_per_insert_error": 3.0})
    client = ReplayBufferClient(buf.front.address)
    room = Reservations(client, "w1")
    try:
        assert room.take(1) == 0  # nothing asked for yet
        room.want(3)
        deadline = time.monotonic() + 10
        while room.held < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert room.take(5) == 3 and room.take(1) == 0
        room.unused(1)  # a fragment that will not be sent: its room is used again
        assert room.take(1) == 1
        room.want(0)
    finally:
        room.close(in_flight=3)  # three fragments begun and never sent: their room goes back
        client.close()
    assert stats(buf.client).reserved_fragments == 0
    assert reserve(buf.client, "w2", 4).granted == 4


def test_the_client_grants_everything_when_the_buffer_has_no_limiter(make_buffer):
    from overworld.replay_buffer.client import ReplayBufferClient

    buf = make_buffer(samples_per_insert=None)
    client = ReplayBufferClient(buf.front.address)
    room = Reservations(client, "w1")
    try:
        room.want(8)
        deadline = time.monotonic() + 10
        while not room.unlimited and time.monotonic() < deadline:
            time.sleep(0.02)
        assert room.take(8) == 8
    finally:
        room.close()
        client.close()
