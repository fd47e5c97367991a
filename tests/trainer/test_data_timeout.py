"""A trainer that gets no data fails after train_config.data_timeout with a message that says what it
waited for, instead of waiting forever (MineStudio's fetch has no timeout). Over a real replay-buffer
front on a loopback socket."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from overworld.replay_buffer.reader import STOP_POLL_SECONDS, NoDataError
from tests.replay_buffer.rb_support import (
    LENGTH,
    SERVICE_DEFAULTS,
    SPACES,
    Backend,
    Buffer,
    insert,
    make_rb_config,
    new_run_id,
)


@pytest.fixture
def empty_buffer(tmp_path: Path) -> Iterator[Buffer]:
    buffer = Buffer(Backend("memory", tmp_path), new_run_id(), make_rb_config(), LENGTH, SPACES, dict(SERVICE_DEFAULTS))
    buffer.add_front()
    yield buffer
    buffer.close()


def test_sample_chunks_fails_after_data_timeout_naming_what_it_waited_for(empty_buffer: Buffer) -> None:
    insert(empty_buffer.client, [empty_buffer.fragment(seq=0)])  # one chunk of the three asked for
    started = time.monotonic()
    with pytest.raises(NoDataError) as err:
        empty_buffer.client.sample(3, "rank-1-r0", wait=0.5, data_timeout=1.5)
    assert time.monotonic() - started < 10
    message = str(err.value)
    assert "rank-1-r0" in message and "train_config.data_timeout=1.5" in message
    assert "2 more of 3 chunks" in message and "holds 0 chunks" in message and "accepted 1 fragments" in message


def test_the_prefetching_reader_hands_the_failure_to_the_learner(empty_buffer: Buffer) -> None:
    reader = empty_buffer.client.reader(chunks_per_batch=2, num_readers=2, prefetch_batches=1, name="rank-0",
                                        wait=0.5, data_timeout=1.0)
    try:
        with pytest.raises(NoDataError, match="rank-0-r"):
            reader.next()  # without data_timeout this would block forever
    finally:
        reader.close()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_reader_told_to_stop_waiting_returns_what_it_has(empty_buffer: Buffer, prefetch: int) -> None:
    # the trainer's stop while the fleet is gone: without it, next() waits for chunks that never come
    insert(empty_buffer.client, [empty_buffer.fragment(seq=0)])  # one chunk of the three asked for
    reader = empty_buffer.client.reader(chunks_per_batch=3, num_readers=1, prefetch_batches=prefetch, name="rank-0",
                                        wait=60.0, data_timeout=None)
    got: list[list] = []
    waiting = threading.Thread(target=lambda: got.append(reader.next()), daemon=True)
    try:
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive()  # one chunk of three: it waits
        reader.stop_waiting()
        waiting.join(STOP_POLL_SECONDS + 5.0)
        assert not waiting.is_alive()
        # what it had claimed; a prefetching reader's partial batch is not handed out (claimed, not trained)
        assert len(got[0]) == (1 if prefetch == 0 else 0)
        assert reader.next() == []  # and nothing more after
    finally:
        reader.close()
