"""The trainer's readers never wait forever: a Sample that fails for good reaches the learner as an
error (the trainer fails and is restarted) instead of leaving it waiting on an empty prefetch queue."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from overworld.core.grpc_util import Refused, serve
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.v1 import replay_buffer_pb2_grpc


class RefusingBuffer(replay_buffer_pb2_grpc.ReplayBufferServicer):
    """A front that refuses every Sample (and says nothing of its store)."""

    def GetStoreInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "num_chunks out of range")

    def Sample(self, request: Any, context: grpc.ServicerContext) -> Any:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "num_chunks out of range")


@pytest.fixture
def refusing() -> Iterator[ReplayBufferClient]:
    server = serve([(replay_buffer_pb2_grpc.add_ReplayBufferServicer_to_server, RefusingBuffer(),
                     "overworld.v1.ReplayBuffer")])
    with ReplayBufferClient(server.address) as client:
        yield client
    server.stop(0)


def test_a_prefetching_reader_hands_a_failed_sample_to_the_learner(refusing: ReplayBufferClient) -> None:
    reader = refusing.reader(chunks_per_batch=4, num_readers=1, prefetch_batches=2, name="r", wait=1.0)
    got: list[BaseException] = []
    learner = threading.Thread(target=lambda: got.append(pytest.raises(grpc.RpcError, reader.next).value),
                               daemon=True)
    learner.start()
    learner.join(10)
    reader.close()
    assert got and got[0].code() == grpc.StatusCode.INVALID_ARGUMENT
