"""A waiting call does not poll an in-process index: a sample that waits for data and an insert held
by the rate limiter sleep until another call changes the buffer, and then go on at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rb_support import LENGTH, SPACES, insert, make_fragment, new_run_id, sample

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.grpc_util import serve
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.replay_buffer.index import MemoryIndex
from overworld.replay_buffer.rate_limiter import RateLimiter
from overworld.replay_buffer.server import ReplayBufferService, add_to_server


class CountingIndex(MemoryIndex):
    """The real in-process index, counting how often a front asks it for work."""

    claims = 0
    adds = 0

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.claims += 1
        return super().claim(*args, **kwargs)

    def add(self, *args: Any, **kwargs: Any) -> Any:
        self.adds += 1
        return super().add(*args, **kwargs)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[Any, CountingIndex, str]]:
    run_id = new_run_id()
    limiter = RateLimiter(samples_per_insert=1.0, error=1.0, min_size=1)  # at most 2 chunks ahead of the samples
    index = CountingIndex(100, 1, 100, 1, limiter)
    service = ReplayBufferService(index, LocalBlobStore(tmp_path), run_id, LENGTH, 1, 100, lambda: SPACES)
    server = serve([(add_to_server, service, "overworld.v1.ReplayBuffer")])
    client = ReplayBufferClient(server.address)
    yield client, index, run_id
    client.close()
    service.stop()
    server.stop(0)


def test_a_waiting_sample_sleeps_until_an_insert(front) -> None:
    client, index, run_id = front
    got: list[Any] = []
    waiting = threading.Thread(target=lambda: got.extend(sample(client, 1, timeout=20.0)))
    waiting.start()
    time.sleep(2.0)
    assert index.claims <= 2, f"a waiting sample asked the index {index.claims} times in 2 s"
    insert(client, [make_fragment(run_id, seq=0)], timeout=20)
    waiting.join(10)
    assert len(got) == 1


def test_an_insert_held_by_the_rate_limiter_sleeps_until_a_sample(front) -> None:
    client, index, run_id = front
    acks: list[Any] = []
    inserting = threading.Thread(target=lambda: acks.extend(insert(
        client, [make_fragment(run_id, seq=i) for i in range(4)], timeout=30)))
    inserting.start()
    deadline = time.monotonic() + 10
    while index.adds < 3 and time.monotonic() < deadline:  # two admitted, the third held
        time.sleep(0.05)
    held = index.adds
    time.sleep(2.0)
    assert index.adds - held <= 3, f"a held insert asked the index {index.adds - held} times in 2 s"
    assert len(sample(client, 2, timeout=10.0)) == 2  # room for the other two
    inserting.join(10)
    assert len(acks) == 4
