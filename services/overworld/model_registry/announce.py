"""The watch path: every watcher's stream of announcements (each new version, and where to fetch it
from: by relay, stripes from other workers as `relay_plan.py` plans them; else the registry), the
watchers' acknowledgements (`pushes.py`) and the push status."""

from __future__ import annotations

import ipaddress
import re
import time
import urllib.parse
from collections.abc import Iterator

import grpc

from overworld.core.grpc_util import Refused
from overworld.core.wire import safetensors_format
from overworld.model_registry import chunks
from overworld.model_registry.payload import Payload, PayloadFailed
from overworld.model_registry.relay_plan import FAULTS, REGISTRY, Member, RelayPlan, relay_chunk_bytes
from overworld.model_registry.store import RegistryStore, log
from overworld.v1 import model_registry_pb2 as pb

HOST_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*")
RELAY_PLANS_KEPT = 4
MAX_FAULTS = 64  # relay faults read from one acknowledgement  # (version, precision) plans kept for watchers that connect during a push


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.5:41234" -> "10.0.0.5", "ipv6:%5B::1%5D:5" -> "[::1]");
    "" for a peer that has no network address (a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host, _, _ = urllib.parse.unquote(rest).rpartition(":")
    return host


def relay_host(text: str) -> str:
    """A watcher's own relay host, checked: an IP address ("[...]" around IPv6) or a DNS name."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        if not HOST_RE.fullmatch(text):
            raise ValueError(f"relay_host {text[:80]!r} is neither an IP address nor a host name") from None
        return text
    return f"[{address}]" if address.version == 6 else str(address)


class Watching(RegistryStore):
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.VersionInfo]:
        """The star's watch (and an older release's watchers): every version to fetch from here."""
        for announcement in self._watch(request, context, relayed=False):
            yield announcement.info

    def WatchAnnouncements(self, request: pb.WatchRequest, context: grpc.ServicerContext
                           ) -> Iterator[pb.Announcement]:
        yield from self._watch(request, context, relayed=True)

    def _watch(self, request: pb.WatchRequest, context: grpc.ServicerContext, relayed: bool
               ) -> Iterator[pb.Announcement]:
        watcher = request.watcher_id or context.peer()
        known = request.known_version
        try:
            # one name per precision ('bf16' and 'bfloat16' share a variant and a relay plan)
            precision = safetensors_format.half_precision(request.precision) or ""
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"WatchRequest.precision: {err}") from None
        if request.relay_port > 65535:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"relay_port {request.relay_port} is not a TCP port")
        try:
            own = relay_host(request.relay_host) if request.relay_host else ""
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"WatchRequest.{err}") from None
        host = (own or peer_host(context.peer())) if request.relay_port and relayed else ""
        member = Member(watcher, f"{host}:{request.relay_port}" if host else "", precision, relayed)
        with self._lock:
            self._pushes.joined(member, known)

        def wake() -> None:
            with self._lock:
                self._lock.notify_all()

        context.add_callback(wake)
        sent_seq, sent_version = -1, known
        last_write = time.monotonic()
        try:
            while True:
                head: Payload | None = None
                with self._lock:
                    while True:
                        if self._stopping or not context.is_active():
                            return
                        head = self._head
                        if head is not None and head.seq != sent_seq:
                            version = head.info.version
                            # the first message tells where the registry is; then a newer version, or the
                            # same version published again after a failed attempt
                            if (version != known) if sent_seq == -1 else (version >= sent_version):
                                sent_seq, sent_version = head.seq, version
                                break
                            sent_seq = head.seq
                        head = None
                        idle = time.monotonic() - last_write
                        if idle >= self.keepalive:
                            # gRPC servers refuse client keep-alive pings on a stream that sends nothing
                            # (GOAWAY "too_many_pings"): repeat the last announcement now and then
                            break
                        self._lock.wait(min(5.0, self.keepalive - idle))
                if head is None:
                    announcement: pb.Announcement | None = pb.Announcement(
                        info=pb.VersionInfo(version=max(sent_version, 0)))
                else:
                    announcement = self._announcement(head, member, context)
                if announcement is not None:
                    last_write = time.monotonic()
                    yield announcement
        finally:
            with self._lock:
                self._pushes.left(watcher)

    def _announcement(self, head: Payload, member: Member, context: grpc.ServicerContext) -> pb.Announcement | None:
        """The announcement of `head` to one watcher: the info of the bytes it will receive (in its
        precision), where each stripe comes from over the weights stream (by relay: the plan's; else the
        registry) and the hash of each chunk. None if the version cannot be sent in that precision (its
        publish failed meanwhile, or it does not convert): nothing to announce."""
        version = head.info.version
        with self._lock:
            info = self._info(version) if version in self._versions else head.info
        if not member.relayed or not info.sha256 or not self.weights_port:
            return pb.Announcement(info=info)  # Watch (an older release's watchers), or cut-through: Fetch
        try:
            payload = self._payload(version)
            if member.precision:  # the sha256 and size of what this watcher will receive
                payload = payload.variant(member.precision, context.is_active)
                info = payload.info
            chunk = relay_chunk_bytes(info.size_bytes)
            hashes = payload.chunk_hashes(chunk)
        except PayloadFailed as err:
            log.warning("not announcing version %d to %s: %s", version, member.watcher, err)
            return None
        sources: list[str] = []
        depths: list[int] = []
        if self.relay_fanout:
            with self._lock:
                key = (version, member.precision)
                plan = self._plans.get(key)
                if plan is None:
                    members = self._exclusions.apply(self._pushes.member_list(member.precision), version)
                    plan = self._plans[key] = RelayPlan(members, self.relay_fanout)
                    for old in sorted(self._plans)[:-RELAY_PLANS_KEPT]:
                        del self._plans[old]
                sources = plan.place(member)
                depths = plan.source_depths(member.watcher)
        return pb.Announcement(info=info, sources=sources or [REGISTRY], chunk_bytes=chunk,
                               weights_port=self.weights_port, chunk_hashes=hashes, chunk_hash=chunks.CHUNK_HASH,
                               source_depths=depths if sources else [0])

    def AckVersion(self, request: pb.AckVersionRequest, context: grpc.ServicerContext) -> pb.AckVersionResponse:
        now = time.monotonic()
        with self._lock:
            self._pushes.ack(request.watcher_id, request.version, now)
            newest = max(self.latest(), self._head.info.version if self._head else 0)
            for fault in request.relay_faults[:MAX_FAULTS]:
                if fault.reason not in FAULTS:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"AckVersionRequest.relay_faults: a reason is one of "
                                  f"{FAULTS}, not {fault.reason[:50]!r}")
                # believed only from a child of that relay in the plan of that version (a worker cannot
                # report relays it was not given), and applied to the watcher that relays there
                plans = [plan for (version, _), plan in self._plans.items() if version == fault.version]
                relay = next((plan.watcher_at(fault.relay) for plan in plans
                              if plan.is_source_of(fault.relay, request.watcher_id)), None)
                if relay is None:
                    log.warning("relay fault from %s ignored: %s was not its source for version %d", request.watcher_id,
                                fault.relay[:300], fault.version)
                    continue
                # a fault is of a version announced: none later (a report cannot exclude a relay for good)
                self._exclusions.report(relay, fault.reason, min(fault.version, newest))
        return pb.AckVersionResponse()

    def GetPushStatus(self, request: pb.PushStatusRequest, context: grpc.ServicerContext) -> pb.PushStatus:
        deadline = time.monotonic() + max(0.0, request.wait_seconds)
        with self._lock:
            version = request.version or self.latest()
            while True:
                push = self._pushes.pushes.get(version)
                if push is None or push.complete or self._stopping or not context.is_active():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, 1.0))
            return self._pushes.status(version, version in self._versions)

