"""A learner rank told to stop while it waits for samples: the fleet may be gone (a run's end, a
preemption), and the batch it waits for may never be completed. Every rank asks the driver every
STOP_PROBE_SECONDS; told to stop, its reader returns what it has, the ranks agree that the iteration
came back short (runtime.stopped_waiting), and it is not trained: the last iteration trained is the one
checkpointed."""

from __future__ import annotations

import threading

import grpc
import torch
import torch.distributed as dist

from overworld.replay_buffer.reader import ChunkReader
from overworld.trainer.client import TrainerClient

STOP_PROBE_SECONDS = 2.0  # how often a rank asks the driver whether to stop


class StoppedWaiting(Exception):
    """The driver asked to stop while a rank waited for samples: the iteration is not trained (its chunks
    are claimed; the summary counts their steps as `claimed_not_trained`)."""


def watch_for_stop(status: TrainerClient | None, reader: ChunkReader) -> threading.Event:
    """A thread that, once the driver says stop, tells the reader to stop waiting for samples; it ends
    when the returned event is set."""
    done = threading.Event()

    def watch() -> None:
        while status is not None and not done.wait(STOP_PROBE_SECONDS):
            try:
                stop = status.status(timeout=STOP_PROBE_SECONDS).stop_requested
            except grpc.RpcError:
                continue  # advisory: the iteration boundary still sees the stop
            if stop:
                reader.stop_waiting()
                return

    threading.Thread(target=watch, name="stop-probe", daemon=True).start()
    return done


def any_rank(short: bool, distributed: bool, device: torch.device) -> bool:
    """Whether any rank's batch came back short: then no rank trains this iteration, so that their
    collectives stay matched."""
    if distributed:
        flag = torch.tensor(float(short), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        short = bool(flag.item())
    return short
