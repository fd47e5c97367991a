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
from rb_support import insert, sample, stats, wait_until

from overworld.replay_buffer.reservations import Reservations
from overworld.v1 import replay_buffer_pb2

LIMITED = {"samples_per_insert": 1.0, "samples_per_insert_error": 1.0, "min_size_to_sample": 1, "max_reuse": 1}


def reserve(client, worker: str, n: int, wait: float = 0.0, give_back: int = 0,
            starting: int = 0) -> replay_buffer_pb2.ReserveResponse:
    return client.reserve(worker, n, starting=starting, wait=wait, give_back=give_back, timeout=10)


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


def test_a_call_granted_nothing_does_not_keep_room_alive(make_buffer):
    """A holder asking again and again while the band is full must not keep its old room for ever (the
    fuzz test's Reserve calls once held all the room this way)."""
    buf = make_buffer(service={"reservation_ttl": 0.8}, **LIMITED)
    granted_at = time.monotonic()
    assert reserve(buf.client, "w1", 2).granted == 2
    while time.monotonic() < granted_at + 0.5:  # the band is full: nothing more for w1
        assert reserve(buf.client, "w1", 1).granted == 0
        time.sleep(0.05)
    time.sleep(max(0.0, granted_at + 0.9 - time.monotonic()))  # the ttl counts from the grant, not the asks
    assert reserve(buf.client, "w2", 2).granted == 2
    assert stats(buf.client).expired_reservations == 2


def test_room_goes_first_to_workers_going_on_with_their_episodes(make_buffer):
    """Fragments that would begin an episode get room only beyond what other workers wait for to go on
    with episodes they began: the fleet finishes what it started."""
    buf = make_buffer(**LIMITED)
    assert reserve(buf.client, "w1", 2).granted == 2
    assert reserve(buf.client, "w1", 2).granted == 0  # w1 waits for room to go on: remembered
    insert(buf.client, [buf.fragment(worker="w1", slot=s, seq=0) for s in range(2)])
    assert len(sample(buf.client, 1)) == 1  # room for one
    assert reserve(buf.client, "w2", 1, starting=1).granted == 0  # w1 goes first
    assert reserve(buf.client, "w2", 2, starting=1).granted == 1  # w2 going on with one of its own: fine
    assert reserve(buf.client, "w1", 0).granted == 0  # w1 no longer waits
    assert len(sample(buf.client, 1)) == 1
    assert reserve(buf.client, "w2", 1, starting=1).granted == 1


def test_reserve_calls_beyond_the_front_s_waiting_limit_are_refused(make_buffer):
    """Each waiting Reserve holds a server thread: past `max_waiting_reserves` one more that would wait is
    refused at once with a reason, one that need not wait is answered, and the waiting ones are served."""
    buf = make_buffer(service={"max_waiting_reserves": 2}, **LIMITED)
    assert reserve(buf.client, "w0", 2).granted == 2
    replies: queue.Queue = queue.Queue()
    waiters = [threading.Thread(target=lambda w=w: replies.put(reserve(buf.client, w, 1, wait=20.0)))
               for w in ("w1", "w2")]
    for t in waiters:
        t.start()
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as err:
        reserve(buf.client, "w3", 1, wait=20.0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 Reserve calls already wait" in err.value.details() and "--max-waiting-reserves" in err.value.details()
    assert reserve(buf.client, "w3", 1).granted == 0  # no wait asked: answered, not refused
    reserve(buf.client, "w0", 0, give_back=2)
    assert sorted(replies.get(timeout=10).granted for _ in waiters) == [1, 1]
    for t in waiters:
        t.join(5)


def test_with_reservations_off_every_request_is_granted_and_fragments_meet_the_limiter(make_buffer):
    buf = make_buffer(service={"reservations": False}, **LIMITED)
    reply = reserve(buf.client, "w1", 50)
    assert (reply.granted, reply.limited) == (50, False)
    assert stats(buf.client).reserved_fragments == 0
    insert(buf.client, [buf.fragment(worker="w1", seq=q) for q in range(2)])  # the band: two chunks
    acks: queue.Queue = queue.Queue()
    t = threading.Thread(target=lambda: acks.put(insert(buf.client, [buf.fragment(worker="w1", seq=2)], timeout=20)))
    t.start()
    with pytest.raises(queue.Empty):
        acks.get(timeout=0.5)  # held at the door until the sampler draws
    assert len(sample(buf.client, 1)) == 1
    assert len(acks.get(timeout=10)) == 1
    t.join(5)


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
    ({"worker_id": "w1", "fragments": 1, "starting": 2}, "starting must be at most fragments"),
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
        wait_until(lambda: room.unlimited, what="the client to learn the buffer does not limit")
        assert room.take(8) == 8
    finally:
        room.close()
        client.close()


def test_a_client_that_met_an_old_front_asks_again_later(make_buffer, monkeypatch):
    """A front that predates Reserve (UNIMPLEMENTED) lets the worker step unreserved, but only until it
    asks again: here the old front is replaced, on the same address, by one that limits."""
    from overworld.core.grpc_util import serve
    from overworld.replay_buffer import reservations
    from overworld.replay_buffer.client import ReplayBufferClient

    monkeypatch.setattr(reservations, "ASK_AGAIN_SECONDS", 1.0)
    old = serve([])  # a gRPC server without the ReplayBuffer service: Reserve is UNIMPLEMENTED
    port = int(old.address.rsplit(":", 1)[1])
    client = ReplayBufferClient(old.address)
    room = Reservations(client, "w1")
    try:
        room.want(5)
        wait_until(lambda: room.unlimited, what="the client to step unreserved")
        assert room.take(5) == 5  # unreserved, for now
        old.stop(0)
        buf = make_buffer(fronts=0, **LIMITED)
        buf.add_front(port=port)
        wait_until(lambda: not room.unlimited and room.held == 2, what="the client to ask the new front again")
        assert room.take(5) == 2  # asked again: the new front grants the band, two, and no more
        assert room.take(5) == 0
    finally:
        room.close()
        client.close()
