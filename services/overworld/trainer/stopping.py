"""A learner rank told to stop. Every rank asks the driver every STOP_PROBE_SECONDS.

Waiting for samples: the fleet may be gone (a run's end, a preemption), and the batch it waits for may
never be completed. Told to stop, its reader returns what it has, the ranks agree that the iteration
came back short, and it is not trained: the last iteration trained is the one checkpointed.

Updating: the stop may come with a deadline (the driver's pod's grace period). An update that would
end too late for the checkpoint is cut short between optimizer steps (`StopDeadline.late`); the iteration
counts as trained with the steps it took, and is the one checkpointed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
import torch
import torch.distributed as dist

from overworld.replay_buffer.reader import ChunkReader
from overworld.trainer.client import TrainerClient

log = logging.getLogger("overworld.trainer")

STOP_PROBE_SECONDS = 2.0  # how often a rank asks the driver whether to stop
# After the checkpoint, before the deadline: the final report and the rank's exit.
STOP_MARGIN_SECONDS = 3.0
# What a checkpoint is taken to cost before this rank has timed one.
UNTIMED_CHECKPOINT_SECONDS = 10.0


class StoppedWaiting(Exception):
    """The driver asked to stop while a rank waited for samples: the iteration is not trained (its chunks
    are claimed; the summary counts their steps as `claimed_not_trained`)."""


def watch_for_stop(status: TrainerClient | None, reader: ChunkReader,
                   on_deadline: Callable[[float], None]) -> threading.Event:
    """A thread that, once the driver says stop, tells the reader to stop waiting for samples and, if
    the stop has a deadline, calls `on_deadline` with it (time.monotonic() here); it ends when the
    returned event is set."""
    done = threading.Event()

    def watch() -> None:
        while status is not None and not done.wait(STOP_PROBE_SECONDS):
            asked = time.monotonic()
            try:
                answer = status.status(timeout=STOP_PROBE_SECONDS)
            except grpc.RpcError:
                continue  # advisory: the iteration boundary still sees the stop
            if answer.stop_requested:
                if answer.stop_seconds_left > 0:  # counted from the question: the answer's trip is margin
                    on_deadline(asked + answer.stop_seconds_left)
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


class StopDeadline:
    """When a stop must be checkpointed by (time.monotonic()), once the driver has said, and what a
    checkpoint costs (the last one's time, `timed` by the runtime)."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.checkpoint_seconds = UNTIMED_CHECKPOINT_SECONDS

    def set(self, at: float) -> None:
        self.at = at
        log.info("stop requested with %.0fs to checkpoint in", at - time.monotonic())

    def late(self, step_seconds: float) -> bool:
        """Whether one more optimizer step and then the checkpoint would end after the deadline (this
        rank's view: the learner agrees on it with the others in its optimizer step's all-reduce)."""
        return self.at is not None and time.monotonic() + step_seconds + self.checkpoint_seconds + STOP_MARGIN_SECONDS > self.at
