"""Room lives as long as a lease: a front reserves room only for workers holding a lease at a real
rollout-manager (on a real socket), and gives back the room of a worker whose lease lapsed within the
lease and two refreshes of the front's list, not the reservation ttl. Both backends."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from rb_support import SPACES, insert, sample, stats

from overworld.core.config import load_config
from overworld.core.grpc_util import serve
from overworld.replay_buffer.leases import Leases
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_manager.server import RolloutManagerService
from overworld.v1 import rollout_manager_pb2 as pb
from overworld.v1 import rollout_manager_pb2_grpc

LIMITED = {"samples_per_insert": 1.0, "samples_per_insert_error": 1.0, "min_size_to_sample": 1, "max_reuse": 1}
LEASE_SECONDS = 1.0
REFRESH_SECONDS = 0.25


@pytest.fixture
def manager() -> Iterator[RolloutManagerClient]:
    config = load_config({"run_id": "leases", "train_config": {"batches_per_iteration": 1, "gradient_accumulation": 1}})
    service = RolloutManagerService(config, lease_seconds=LEASE_SECONDS)
    server = serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, service,
                     "overworld.v1.RolloutManager")])
    client = RolloutManagerClient(server.address)
    yield client
    client.close()
    server.stop(0)


def register(manager: RolloutManagerClient) -> str:
    return manager.register(pb.RegisterRequest(hostname="h", num_envs=2, spaces=SPACES.to_proto())).worker_id


def leased_buffer(make_buffer, manager: RolloutManagerClient, **service):
    leases = Leases(lambda: manager.leases().worker_ids, refresh=REFRESH_SECONDS)
    return make_buffer(service={"leases": leases, "reservation_ttl": 60.0, **service}, **LIMITED)


def test_room_only_for_a_worker_that_holds_a_lease(make_buffer, manager):
    buf = leased_buffer(make_buffer, manager)
    with pytest.raises(grpc.RpcError) as err:
        buf.client.reserve("w-impostor", 1, timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "w-impostor holds no lease" in err.value.details()
    worker = register(manager)
    time.sleep(0.1)  # a front looks again for an unknown worker at most every 0.05 s (a flood of unknown ids
    # costs the manager 20 lists a second); then one just registered is found without waiting for the refresh
    assert buf.client.reserve(worker, 1, timeout=5).granted == 1
    assert stats(buf.client).reserved_fragments == 1


def test_the_room_of_a_worker_whose_lease_lapsed_comes_back_within_the_lease(make_buffer, manager):
    dead, alive = register(manager), register(manager)
    buf = leased_buffer(make_buffer, manager)
    assert buf.client.reserve(dead, 2, timeout=5).granted == 2  # the whole band
    started = time.monotonic()
    while buf.client.reserve(alive, 1, timeout=5).granted == 0:
        manager.heartbeat(pb.HeartbeatRequest(worker_id=alive))  # `alive` keeps its lease, `dead` does not
        assert time.monotonic() - started < LEASE_SECONDS + 3 * REFRESH_SECONDS + 1.0, "room still held"
        time.sleep(0.05)
    assert time.monotonic() - started >= LEASE_SECONDS * 0.9  # not before the lease lapsed
    assert stats(buf.client).expired_reservations == 2  # the reservation ttl (60 s) had no part in it


def test_a_live_worker_keeps_its_room_past_the_refreshes(make_buffer, manager):
    worker = register(manager)
    buf = leased_buffer(make_buffer, manager)
    assert buf.client.reserve(worker, 2, timeout=5).granted == 2
    for _ in range(int(3 * LEASE_SECONDS / 0.2)):
        manager.heartbeat(pb.HeartbeatRequest(worker_id=worker))
        time.sleep(0.2)
    assert stats(buf.client).reserved_fragments == 2


def test_a_worker_that_joins_gets_its_share_of_the_band(make_buffer, manager):
    """Fragments that would begin episodes wait behind the others' episodes under way, but only behind
    each other worker's share of the band (the band over the workers holding leases): a worker that joins
    a fleet whose first worker could use the whole band is not left idle for good."""
    first, joined = register(manager), register(manager)  # two leases: a share of one fragment each
    buf = leased_buffer(make_buffer, manager)
    assert buf.client.reserve(first, 2, timeout=5).granted == 2  # the whole band
    assert buf.client.reserve(first, 2, timeout=5).granted == 0  # and it waits to go on with two more
    insert(buf.client, [buf.fragment(worker=first, slot=s, seq=0) for s in range(2)])
    assert len(sample(buf.client, 2)) == 2  # room for two
    assert buf.client.reserve(joined, 2, starting=2, timeout=5).granted == 1  # beyond the first's share of one


def test_a_joining_worker_gets_its_share_though_the_first_asks_first_each_time(make_buffer, manager):
    """A worker that could use the whole band and always asks first when room frees (its Reserve call
    waits at the front) takes for its episodes under way only its share while a joined worker waits:
    the joined worker's first episodes go ahead of what is beyond the first worker's share."""
    first, joined = register(manager), register(manager)  # two leases: a share of one fragment each
    buf = leased_buffer(make_buffer, manager)
    assert buf.client.reserve(first, 2, timeout=5).granted == 2
    insert(buf.client, [buf.fragment(worker=first, slot=s, seq=0) for s in range(2)])
    assert buf.client.reserve(joined, 2, starting=2, timeout=5).granted == 0  # no room: it waits
    for seq in range(1, 4):
        assert len(sample(buf.client, 2)) == 2  # room for two, and the first asks first
        assert buf.client.reserve(first, 2, timeout=5).granted == 1, f"round {seq}: beyond its share"
        assert buf.client.reserve(joined, 2, starting=2, timeout=5).granted == 1, f"round {seq}: its share"
        insert(buf.client, [buf.fragment(worker=first, slot=0, seq=seq), buf.fragment(worker=joined, slot=0, seq=seq)])
