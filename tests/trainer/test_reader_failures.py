"""The trainer's readers never wait forever: a Sample that fails for good reaches the learner as an
error (the trainer fails and is restarted) instead of leaving it waiting on an empty prefetch queue."""

from __future__ import annotations

import threading

import grpc
import pytest

from overworld.replay_buffer.client import ReplayBufferClient


class Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self) -> str:
        return "num_chunks out of range"


class RefusingStub:
    def GetStoreInfo(self, request, timeout=None):  # type: ignore[no-untyped-def]
        raise Refused()

    def Sample(self, request, timeout=None):  # type: ignore[no-untyped-def]
        raise Refused()


def test_a_prefetching_reader_hands_a_failed_sample_to_the_learner() -> None:
    reader = ReplayBufferClient(RefusingStub()).reader(chunks_per_batch=4, num_readers=1, prefetch_batches=2,
                                                       timeout=1.0, name="r")
    got: list[BaseException] = []
    learner = threading.Thread(target=lambda: got.append(pytest.raises(grpc.RpcError, reader.next).value),
                               daemon=True)
    learner.start()
    learner.join(10)
    reader.close()
    assert got and got[0].code() == grpc.StatusCode.INVALID_ARGUMENT
