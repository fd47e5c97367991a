"""Keeps a watch stream open on the model-registry and fetches each new version in the background.

The worker's loop calls `take()` between two inference batches and loads what it returns; it never
waits on the registry except for the very first version (`wait_first`). Then it calls `ack(version)`,
which does not wait either: the registry measures the push latency from these acknowledgements.

Two threads: one reads the Watch stream (announcements), one fetches. A version announced while
another is being fetched is fetched next; versions announced in between are skipped (the worker
always catches up to the newest). When the stream breaks (registry restart, network), the watcher
reconnects with `known_version` and the registry announces its latest version at once.

Each version comes over the weights stream (`stream/protocol.py`, `worker/relay.py`): stripes from other workers and
the registry, as the announcement names them, into one buffer that is reused from one version to the
next; every chunk is checked against the hash the registry announced as it arrives. The watcher keeps
what it received on its `shelf`, from where its worker's relay passes it on. With `relay_port` the
watcher tells the registry it can relay (its relay serves the shelf there). Relays that lied or
stalled are reported to the registry with the next acknowledgement. A registry that announces no
weights stream (a version announced before its sha256 is known: cut-through) is fetched with Fetch.

Nothing is copied between the socket and the worker's load_state_dict: each returned tensor is a view
into the version's buffer. Treat them as read-only, and as valid until the next take() returns a
newer version: then the buffer goes back to be received into again (load_state_dict(state) copies
them; load_state_dict(state, assign=True) adopts them, which is fine as long as each version taken is
swapped in before the next take). A relaying worker holds at most two versions besides its model.

Environment (for workers started without code changes): OVERWORLD_WEIGHTS_PRECISION ('' = as
stored, 'bfloat16' or 'float16': the registry halves the floating tensors for the transfer and they
are cast back to the model's dtypes here), OVERWORLD_WEIGHTS_VERIFY ('1' = check the sha256 of a
version fetched with Fetch as well; default '0': the registry checked it when the version was
published and when it read it back from the blob store, and the watcher checks every message's offset
and the size. A version that comes over the weights stream is always checked, chunk by chunk).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import grpc
import torch

from overworld.core.grpc_util import Backoff, attempt_again, call_failed
from overworld.core.wire import safetensors_format, weights
from overworld.model_registry import chunks
from overworld.model_registry.client import FetchBroken, ModelRegistryClient
from overworld.model_registry.worker.relay import (
    MAX_CHUNK,
    MAX_STRIPES,
    MIN_CHUNK,
    RelayedVersion,
    RelayShelf,
    fetch_relayed,
)
from overworld.v1 import model_registry_pb2 as pb

log = logging.getLogger("overworld.model_registry.worker.watcher")
DROP = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED,
        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT)


class WeightsWatcher:
    def __init__(self, address: str, watcher_id: str, like: dict[str, torch.Tensor],
                 precision: str | None = None, verify: bool | None = None, relay_port: int = 0,
                 shelf: RelayShelf | None = None) -> None:
        self.client = ModelRegistryClient(address)
        self.watcher_id = watcher_id
        self.like = {k: torch.empty(0, dtype=v.dtype) for k, v in like.items()}  # only the dtypes matter
        # one name per precision ('bf16' -> 'bfloat16'), as the registry names them; ValueError if unknown
        self.precision = safetensors_format.half_precision(
            os.environ.get("OVERWORLD_WEIGHTS_PRECISION", "") if precision is None else precision) or ""
        self.relay_port = relay_port
        # where other workers reach this one's relay: its pod IP (the chart's OVERWORLD_POD_IP), else the
        # address the registry sees it at
        self.relay_host = os.environ.get("OVERWORLD_POD_IP", "")
        # the registry's weights stream is on the host this watcher reaches it at
        self.registry_host = address.removeprefix("dns:///").rpartition(":")[0]
        self.shelf = shelf or RelayShelf()
        if verify is None:
            verify = os.environ.get("OVERWORLD_WEIGHTS_VERIFY", "0").lower() in ("1", "true", "yes")
        self.verify = verify
        self.version = 0  # the newest version fetched (pending or taken)
        self.announced = 0  # the newest version the registry announced
        self.fetch_seconds = 0.0  # duration of the last fetch
        self._pending: tuple[int, dict[str, torch.Tensor], RelayedVersion | None] | None = None
        self._taken: RelayedVersion | None = None  # the version whose tensors the worker holds
        self._faults: list[tuple[str, str, int]] = []  # relays that failed it, for the next acknowledgement
        self._announcement: pb.Announcement | None = None
        self._first_of_stream = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._stream: Any = None  # the open Watch call
        self._watch_thread = threading.Thread(target=self._watch_loop, name="weights-watch", daemon=True)
        self._fetch_thread = threading.Thread(target=self._fetch_loop, name="weights-fetch", daemon=True)
        self._watch_thread.start()
        self._fetch_thread.start()

    # -- background --------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        backoff = Backoff(0.1)
        while not self._stop.is_set():
            try:
                stream = self.client.watch(self.watcher_id, known_version=self.version, relay_port=self.relay_port,
                                           precision=self.precision, relay_host=self.relay_host)
                self._stream = stream
                first = True
                for announcement in stream:
                    info = announcement.info
                    with self._cond:
                        pending = self._announcement
                        # keep-alives repeat the last announcement: never let one replace a newer one
                        if first or pending is None or info.version > pending.info.version:
                            self._announcement, self._first_of_stream = announcement, first
                            self._cond.notify_all()
                        if info.version:
                            self.announced = info.version if first else max(self.announced, info.version)
                    first = False
                    backoff.reset()
                if self._stop.is_set():
                    return
                log.info("model registry closed the watch stream; reconnecting")
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the stream's deadline: open the next one
                    backoff.reset()
                    continue
                attempt_again("model-registry.Watch")
                log.warning("model registry watch broke (%s); reconnecting from version %d in %.1fs",
                            err.code().name, self.version, backoff.delay)
            backoff.wait(self._stop)

    def _wanted(self) -> pb.Announcement | None:
        announcement = self._announcement
        if announcement is None or announcement.info.version == 0:  # nothing published yet (a keep-alive)
            self._announcement = None
            return None
        # the first announcement of a stream is where the registry is (even if behind us: it was reset)
        version = announcement.info.version
        if version > self.version or (self._first_of_stream and version != self.version):
            return announcement
        self._announcement = None
        return None

    def _fetch_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._stop.is_set() and self._wanted() is None:
                    self._cond.wait(1.0)
                if self._stop.is_set():
                    return
                announcement = self._announcement
                self._announcement = None
            assert announcement is not None
            info = announcement.info
            started = time.monotonic()
            try:
                fetched, state, held = self._fetch(announcement)
            except (FetchBroken, grpc.RpcError, ValueError) as err:
                if self._stop.is_set():
                    return
                if not isinstance(err, grpc.RpcError) or err.code() in DROP:
                    # gone, its publish failed, or what arrived is inconsistent: wait for the next announcement
                    call_failed("model-registry.Fetch")
                    log.warning("model version %d cannot be fetched: %s", info.version,
                                f"{err.code().name} {err.details()}" if isinstance(err, grpc.RpcError) else err)
                    continue
                attempt_again("model-registry.Fetch")
                log.warning("fetching model version %d failed (%s); trying again", info.version, err.code().name)
                with self._cond:  # fetch it again if nothing newer is announced meanwhile
                    if self._announcement is None:
                        self._announcement = announcement
                self._stop.wait(1.0)
                continue
            except Exception:  # a bug, or a thread that cannot start: said, and the next version tried
                log.exception("fetching model version %d failed", info.version)
                self._stop.wait(1.0)
                continue
            self.fetch_seconds = time.monotonic() - started
            with self._cond:
                replaced, self._pending = self._pending, (fetched.version, state, held)
                self.version = fetched.version
                self._cond.notify_all()
            if replaced is not None and replaced[2] is not None:
                replaced[2].release()  # fetched, never taken: its buffer can be received into again
            del state
            log.debug("model version %d fetched in %.2fs", fetched.version, self.fetch_seconds)

    def _fetch(self, announcement: pb.Announcement
               ) -> tuple[pb.VersionInfo, dict[str, torch.Tensor], RelayedVersion | None]:
        """The version announced, as a state dict, and the RelayedVersion its tensors view (held for the
        worker until it takes a newer one); None for one fetched with Fetch."""
        info = announcement.info
        sources = list(announcement.sources)
        count = -(-info.size_bytes // announcement.chunk_bytes) if announcement.chunk_bytes else 0
        streamed = (announcement.weights_port and sources and len(sources) <= MAX_STRIPES
                    and MIN_CHUNK <= announcement.chunk_bytes <= MAX_CHUNK and info.size_bytes
                    and announcement.chunk_hash == chunks.CHUNK_HASH
                    and len(announcement.chunk_hashes) == count * chunks.HASH_BYTES)
        # a large version over slow links takes longer than the 120 s that is plenty for most
        timeout = max(120.0, info.size_bytes / 2e6)
        if not streamed:  # the whole version with Fetch
            fetched, state = self.client.fetch_state(info.version, like=self.like, precision=self.precision,
                                                     verify=self.verify, timeout=timeout, stop=self._stop.is_set)
            return fetched, state, None
        held = self.shelf.begin(info, announcement.chunk_bytes, self.precision, announcement.chunk_hashes)
        faults: list[tuple[str, str]] = []
        try:
            fetch_relayed(held, sources, f"{self.registry_host}:{announcement.weights_port}", self._stop.is_set,
                          timeout, faults, list(announcement.source_depths))
            held.hold()  # the worker's, from here until it takes a newer version
        finally:
            with self._cond:
                self._faults += [(relay, reason, info.version) for relay, reason in faults]
            self.shelf.settle(held, keep=bool(self.relay_port))  # kept only where it is served
        try:
            return info, weights.from_pieces(held.pieces(), self.like), held
        except ValueError as err:  # verified bytes the registry accepted, but not safetensors for this model
            held.release()
            raise FetchBroken(f"version {info.version}: {err}") from None

    # -- the worker's side -------------------------------------------------------------------------------
    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest fetched version not taken yet, or None. Call between two inference batches."""
        with self._cond:
            pending, self._pending = self._pending, None
            if pending is None:
                return None
            version, state, held = pending
            released, self._taken = self._taken, held
        if released is not None:
            released.release()  # the worker swapped in a newer version: the old one's buffer can be reused
        return version, state

    def wait_first(self, stop: threading.Event) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Block until the first version arrives (the trainer publishes its initial weights)."""
        started = last_log = time.monotonic()
        with self._cond:
            while self._pending is None and not stop.is_set() and not self._stop.is_set():
                self._cond.wait(0.5)
                if time.monotonic() - last_log > 30:
                    last_log = time.monotonic()
                    log.info("still waiting for the trainer to publish the first model version (%.0fs)",
                             last_log - started)
        return self.take()

    def ack(self, version: int) -> None:
        """Tell the registry this version is swapped in. Does not wait for the reply."""
        with self._cond:
            faults, self._faults = self._faults, []
        try:
            self.client.ack(self.watcher_id, version, [pb.RelayFault(relay=relay, reason=reason, version=v)
                                                       for relay, reason, v in faults])
        except (grpc.RpcError, ValueError) as err:  # ValueError: the channel is closed
            log.debug("could not acknowledge version %d: %s", version, err)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        self._watch_thread.join(5)
        self._fetch_thread.join(5)
        self.client.close()
