"""Room in the replay buffer, reserved before a rollout worker steps a fragment (Reserve's client side).

A fleet larger than the learner needs would otherwise step as fast as it can and have most of its
fragments dropped as stale at the buffer's door (docs/replay_buffer.md, "Reserving before stepping").
The worker's loop never waits on the network for room: it says how many of its env slots wait at a
fragment boundary (`want`), a thread asks the buffer for that much room (a long poll), and the loop
takes what is held (`take`). A buffer without a rate limiter, or one that predates Reserve, answers
that reserving is not needed; every take is then granted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import grpc

from overworld.core.grpc_util import Backoff
from overworld.v1 import replay_buffer_pb2

log = logging.getLogger("overworld.replay_buffer.reservations")
WAIT_SECONDS = 0.5  # how long one Reserve call waits for room: a stop or a new holder is seen this often
CALL_TIMEOUT = 5.0  # beyond the wait: a buffer that does not answer is asked again (or given up at close)


class ReserveCalls(Protocol):
    """What reservations need of their ReplayBufferClient (declared here: the client imports this module)."""

    def reserve(self, worker_id: str, fragments: int, *, wait: float = 0.0, give_back: int = 0,
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
        self._unlimited = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="reservations", daemon=True)
        self._thread.start()

    @property
    def unlimited(self) -> bool:
        """The buffer admits every fragment: nothing needs reserving."""
        return self._unlimited

    @property
    def held(self) -> int:
        return self._held

    def take(self, n: int) -> int:
        """Up to n fragments' room, from what is held (never waits)."""
        with self._cond:
            if self._unlimited:
                return n
            taken = min(n, self._held)
            self._held -= taken
            return taken

    def want(self, n: int) -> None:
        """`n` slots wait for room now; the thread asks for what is not held."""
        with self._cond:
            self._wanted = n
            if n > self._held:
                self._cond.notify_all()

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
        if n <= 0 or self._unlimited:
            return
        try:
            self._client.reserve(holder, 0, give_back=n, timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:  # the buffer takes it back when the ttl lapses
            log.warning("could not give back %d fragments' room (%s); it lapses at the buffer", n, err.code().name)

    def _run(self) -> None:
        backoff = Backoff(0.1)
        while True:
            with self._cond:
                while not self._closed and (self._unlimited or self._wanted <= self._held):
                    self._cond.wait()
                if self._closed:
                    return
                holder, ask = self._holder, self._wanted - self._held
            try:
                reply = self._client.reserve(holder, ask, wait=WAIT_SECONDS, timeout=WAIT_SECONDS + CALL_TIMEOUT)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the replay buffer does not know Reserve: every fragment is sent unreserved")
                    with self._cond:
                        self._unlimited = True
                    continue
                delay = backoff.next()
                log.warning("could not reserve room in the replay buffer (%s); again in %.1fs", err.code().name, delay)
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, delay)
                continue
            backoff.reset()
            with self._cond:
                if not reply.limited:
                    self._unlimited = True
                    if self._on_room is not None:
                        self._on_room()
                elif holder == self._holder and not self._closed:
                    self._held += reply.granted
                    if reply.granted and self._on_room is not None:
                        self._on_room()
                    continue
            if reply.limited and reply.granted:  # granted to an id the worker no longer has, or after close
                self._give_back(holder, reply.granted)
