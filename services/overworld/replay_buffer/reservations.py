"""Room in the replay buffer, reserved before a rollout worker steps a fragment (Reserve's client side).

A fleet larger than the learner needs would otherwise step as fast as it can and have most of its
fragments dropped as stale at the buffer's door (docs/replay_buffer.md, "Reserving before stepping").
The worker's loop never waits on the network for room: it says how many of its env slots wait at a
fragment boundary (`want`), a thread asks the buffer for that much room (a long poll), and the loop
takes what is held (`take`). A buffer without a rate limiter (or with reservations off), or one that
predates Reserve, answers that reserving is not needed: every take is then granted, and the buffer is
asked again after ASK_AGAIN_SECONDS (the front behind the address may have been replaced by one that
limits). A worker without a lease is refused (FAILED_PRECONDITION) and asks again with backoff: its
heartbeat registers it again, and `change_holder` moves the reservations to the new id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from overworld.core.grpc_util import Backoff, attempt_again, call_failed
from overworld.v1 import replay_buffer_pb2

log = logging.getLogger("overworld.replay_buffer.reservations")
WAIT_SECONDS = 0.5  # how long one Reserve call waits for room: a stop or a new holder is seen this often
CALL_TIMEOUT = 5.0  # beyond the wait: a buffer that does not answer is asked again (or given up at close)
ASK_AGAIN_SECONDS = 60.0  # a buffer that said reserving is not needed is asked again this often


class ReserveCalls(Protocol):
    """What reservations need of their ReplayBufferClient (declared here: the client imports this module)."""

    def reserve(self, worker_id: str, fragments: int, *, starting: int = 0, wait: float = 0.0, give_back: int = 0,
                timeout: float = 10.0) -> replay_buffer_pb2.ReserveResponse: ...


class Reservations:
    """Room held for the fragments of one holder (the worker id its fragments carry)."""

    def __init__(self, client: ReserveCalls, holder: str, on_room: Callable[[], None] | None = None) -> None:
        """`on_room` is called (from the thread) whenever room arrives: the worker's loop wakes to take it."""
        self._client = client
        self._holder = holder
        self._on_room = on_room
        self._held = 0  # granted and not yet taken
        self._wanted = 0  # slots waiting for room
        self._starting = 0  # of them, slots that would begin a new episode
        self._unlimited_until = 0.0  # monotonic: until then every take is granted
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="reservations", daemon=True)
        self._thread.start()

    @property
    def unlimited(self) -> bool:
        """The buffer admits every fragment: nothing needs reserving (until it is asked again)."""
        return time.monotonic() < self._unlimited_until

    def _go_unlimited(self) -> None:
        """Under the lock: every take granted until the buffer is asked again."""
        self._unlimited_until = time.monotonic() + ASK_AGAIN_SECONDS

    @property
    def held(self) -> int:
        return self._held

    def take(self, n: int) -> int:
        """Up to n fragments' room, from what is held (never waits)."""
        with self._cond:
            if self.unlimited:
                return n
            taken = min(n, self._held)
            self._held -= taken
            return taken

    def want(self, n: int, starting: int = 0) -> None:
        """`n` slots wait for room now, `starting` of them to begin a new episode (the buffer serves those
        after every worker's episodes under way); the thread asks for what is not held."""
        with self._cond:
            self._wanted, self._starting = n, min(starting, n)
            if n > self._held:
                self._cond.notify_all()

    def _asks(self) -> tuple[int, int]:
        """Under the lock: (fragments, of them starting) to ask for; what is held goes to going on first."""
        going_on = self._wanted - self._starting
        starting = max(0, self._starting - max(0, self._held - going_on))
        return max(0, going_on - self._held) + starting, starting

    def unused(self, n: int) -> None:
        """Room taken for fragments that will not be sent (an env failed mid-fragment): the buffer still
        holds it for this holder, so the next fragments use it."""
        with self._cond:
            self._held += n

    def change_holder(self, holder: str, in_flight: int) -> None:
        """The worker registered again under a new id: the old id's room (held, and that of the `in_flight`
        fragments, which will carry the new id) goes back; the new id reserves its own."""
        with self._cond:
            old, back = self._holder, self._held + in_flight
            self._holder, self._held = holder, 0
        self._give_back(old, back)

    def close(self, in_flight: int = 0) -> None:
        """Stop asking, and give back what is held and the room of `in_flight` fragments that will not be sent."""
        with self._cond:
            self._closed = True
            back, self._held = self._held + in_flight, 0
            self._cond.notify_all()
        self._thread.join(2.0)  # a call in flight gives back what it is granted (see _run)
        self._give_back(self._holder, back)

    def _give_back(self, holder: str, n: int) -> None:
        if n <= 0 or self.unlimited:
            return
        try:
            self._client.reserve(holder, 0, give_back=n, timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:  # the buffer takes it back when the ttl lapses
            call_failed("replay-buffer.Reserve")  # the room lapses at the buffer instead
            log.warning("could not give back %d fragments' room (%s); it lapses at the buffer", n, err.code().name)

    def _run(self) -> None:
        backoff = Backoff(0.1)
        while True:
            with self._cond:
                while not self._closed and (self.unlimited or self._wanted <= self._held):
                    self._cond.wait(max(0.0, self._unlimited_until - time.monotonic()) if self.unlimited else None)
                if self._closed:
                    return
                holder, (ask, starting) = self._holder, self._asks()
            try:
                reply = self._client.reserve(holder, ask, starting=starting, wait=WAIT_SECONDS,
                                             timeout=WAIT_SECONDS + CALL_TIMEOUT)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the replay buffer does not know Reserve: fragments go unreserved; asking again in "
                             "%.0fs", ASK_AGAIN_SECONDS)
                    with self._cond:
                        self._go_unlimited()
                    continue
                attempt_again("replay-buffer.Reserve")
                delay = backoff.next()
                log.warning("could not reserve room in the replay buffer (%s: %s); again in %.1fs", err.code().name,
                            err.details(), delay)
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, delay)
                continue
            backoff.reset()
            with self._cond:
                if not reply.limited:
                    self._go_unlimited()
                    if self._on_room is not None:
                        self._on_room()
                elif holder == self._holder and not self._closed:
                    self._held += reply.granted
                    if reply.granted and self._on_room is not None:
                        self._on_room()
                    continue
            if reply.limited and reply.granted:  # granted to an id the worker no longer has, or after close
                self._give_back(holder, reply.granted)
