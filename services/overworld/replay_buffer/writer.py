"""The writer: a rollout worker's fragments streamed to the replay buffer with acknowledgements,
backpressure and reconnects.

The queue is bounded (`to_send_queue_size`): when the buffer is slow or gone, the worker blocks
instead of growing memory. Fragments sent but not yet acknowledged are sent again on reconnect, in
order (capped exponential backoff between attempts); the buffer recognises one it had indexed
already (its ack was lost with the stream) by its (worker, slot, sequence) and acknowledges it
without indexing it twice. Each stream has a generation number; a request generator of a dead
stream takes nothing more.

With an acknowledgement log (`OVERWORLD_ACK_LOG`, a file path), every acknowledgement is appended
to it as "worker_id env_slot sequence stored" and fsynced before the fragment leaves the unacked
queue: a durable, worker-side record of what the buffer promised to keep (the chaos test checks
it against the buffer's own durable record). Off by default: it costs an fsync per fragment.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc

from overworld.core.grpc_util import Backoff, attempt_again, call_failed
from overworld.v1 import common_pb2, replay_buffer_pb2

log = logging.getLogger("overworld.replay_buffer.writer")
STOP_CHECK_SECONDS = 1.0
WAITING_CALL_SECONDS = 0.25


class InsertStreams(Protocol):
    """What the writer needs of its ReplayBufferClient (declared here: the client imports this module)."""

    @property
    def address(self) -> str: ...

    def insert(self, requests: Iterator[replay_buffer_pb2.InsertRequest], *, timeout: float | None = None
               ) -> Iterator[replay_buffer_pb2.InsertResponse]: ...


class FragmentWriter:
    """Fragments queued by `put`, sent in order on one Insert stream at a time (made by
    `ReplayBufferClient.writer`)."""

    def __init__(self, client: InsertStreams, queue_size: int, ack_log: str | None = None) -> None:
        self.client = client
        self.address = client.address
        # O_APPEND: the workers of a machine may share one log (each line is one write)
        self._ack_log = os.open(ack_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if ack_log else None
        self.capacity = max(1, queue_size)
        self.sent = 0
        self.rejected = 0
        self.waiting = False  # a put() is held by backpressure now
        self._pending: deque[common_pb2.Fragment] = deque()
        self._unacked: deque[common_pb2.Fragment] = deque()
        self._cond = threading.Condition()
        self._generation = 0
        self._closing = False
        self._give_up_at = float("inf")  # closing: stop retrying then
        self._thread = threading.Thread(target=self._run, name="fragment-sender", daemon=True)
        self._thread.start()

    def put(self, fragment: common_pb2.Fragment, stop: threading.Event, force: bool = False,
            while_waiting: Callable[[], None] | None = None) -> bool:
        """Block while the queue is full (backpressure); False if `stop` was set meanwhile.
        `force` (shutdown only) queues beyond the bound: complete fragments are never thrown away.
        `while_waiting` runs every WAITING_CALL_SECONDS while blocked, outside the queue's lock (the
        worker swaps in new weights then: it acts with them as soon as it may step again)."""
        with self._cond:
            try:
                while not force and len(self._pending) + len(self._unacked) >= self.capacity:
                    self.waiting = True
                    if stop.is_set():
                        return False
                    if while_waiting is not None:
                        self._cond.release()
                        try:
                            while_waiting()
                        finally:
                            self._cond.acquire()
                        if len(self._pending) + len(self._unacked) < self.capacity:
                            break
                    # an acknowledgement notifies; the timeout bounds a stop and the next while_waiting
                    self._cond.wait(WAITING_CALL_SECONDS if while_waiting is not None else STOP_CHECK_SECONDS)
            finally:
                self.waiting = False
            self._pending.append(fragment)
            self._cond.notify_all()
            return True

    def depth(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._unacked)

    def _requests(self, generation: int) -> Iterator[replay_buffer_pb2.InsertRequest]:
        with self._cond:
            resend = list(self._unacked)
        for fragment in resend:
            yield replay_buffer_pb2.InsertRequest(fragment=fragment)
        while True:
            with self._cond:
                while not self._pending and not self._closing and generation == self._generation:
                    self._cond.wait()  # put(), close() and a new stream notify
                if generation != self._generation or (self._closing and not self._pending):
                    return
                item = self._pending.popleft()
                self._unacked.append(item)
            yield replay_buffer_pb2.InsertRequest(fragment=item)

    def _run(self) -> None:
        backoff = Backoff(0.1)
        while True:
            with self._cond:
                self._generation += 1
                generation = self._generation
            try:
                for ack in self.client.insert(self._requests(generation)):
                    if self._ack_log is not None:
                        os.write(self._ack_log, f"{ack.worker_id} {ack.env_slot} {ack.sequence} "
                                                f"{int(ack.stored)}\n".encode())
                        os.fsync(self._ack_log)
                    with self._cond:
                        self._unacked.popleft()
                        self._cond.notify_all()
                    self.sent += 1
                    backoff.reset()
                with self._cond:
                    if self._closing and not self._pending and not self._unacked:
                        return
            except grpc.RpcError as err:
                with self._cond:
                    self._generation += 1  # retire this stream's request generator
                    self._cond.notify_all()
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    with self._cond:
                        bad = self._unacked.popleft() if self._unacked else None
                        self._cond.notify_all()
                    self.rejected += 1
                    log.error("replay buffer rejected fragment %s: %s",
                              bad.header.sequence if bad else "?", err.details())
                    continue
                attempt_again("replay-buffer.Insert")
                delay = backoff.next()
                log.warning("replay buffer %s unavailable (%s); %d fragments to send again, retrying in %.1fs",
                            self.address, err.code().name, len(self._unacked), delay)
                with self._cond:
                    if self._closing and time.monotonic() + delay > self._give_up_at:
                        call_failed("replay-buffer.Insert")
                        log.error("giving up on %d unsent fragments at shutdown", len(self._pending) + len(self._unacked))
                        return
                time.sleep(delay)

    def close(self, timeout: float = 30.0) -> bool:
        """Send everything queued and wait for the acknowledgements (retrying a buffer that is away for
        up to `timeout`); True if all were acknowledged."""
        with self._cond:
            self._closing = True
            self._give_up_at = time.monotonic() + timeout
            self._cond.notify_all()
        self._thread.join(timeout + 1)
        if self._ack_log is not None and not self._thread.is_alive():
            os.close(self._ack_log)
            self._ack_log = None
        with self._cond:
            return not self._pending and not self._unacked
