"""Services and the cluster DNS: a DNS server on the control host answers for Services with their
ready pods (a ClusterIP name with one, a headless one with all)."""

from __future__ import annotations

import contextlib
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from rehearsal.cluster_state import ClusterState
from rehearsal.pods import DOMAIN, NAMESPACE, Pod, ServiceEntry


class ServicesDns(ClusterState):
    def add_service(self, name: str, selector: dict[str, str], headless: bool) -> None:
        with self.lock:
            self.services[name] = ServiceEntry(name, dict(selector), headless)

    def remove_service(self, name: str) -> None:
        with self.lock:
            self.services.pop(name, None)

    def endpoints(self, service: str) -> list[Pod]:
        with self.lock:
            entry = self.services.get(service)
            if entry is None:
                return []
            return [p for p in self.pods if p.ready and not p.deleting and p.phase == "Running"
                    and all(p.template.labels.get(k) == v for k, v in entry.selector.items())]

    def resolve(self, name: str) -> str | None:
        """What a pod would connect to for a Service name (or an IP, as is)."""
        if name[0].isdigit():
            return name
        short = name.split(".")[0]
        pods = self.endpoints(short)
        return pods[0].ip if pods else None

    def addresses(self, name: str) -> list[str]:
        """The cluster DNS answer for a name: a Service's ready pods (one for a ClusterIP), or a pod."""
        name = name.rstrip(".").lower()
        for suffix in (f".{DOMAIN}", f".{NAMESPACE}.svc", f".{NAMESPACE}"):
            name = name.removesuffix(suffix)
        with self.lock:
            entry = self.services.get(name)
            if entry is None:
                return [p.ip for p in self.pods if p.name == name and p.phase == "Running" and not p.deleting]
            pods = self.endpoints(name)
            if not pods:
                return []
            if entry.headless:
                return sorted(p.ip for p in pods)
            chosen = self._clusterip_choice.get(name)
            if chosen not in [p.ip for p in pods]:
                chosen = pods[0].ip
                self._clusterip_choice[name] = chosen
            return [chosen]

    def _serve_dns(self) -> None:
        """The cluster's DNS (port 53 of the control host): A records from :meth:`addresses`, with a
        1 s TTL; every pod's resolv.conf points here (gRPC's c-ares resolver, in Ray for one, does
        not read /etc/hosts)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 53))
        sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                query, client = sock.recvfrom(512)
            except TimeoutError:
                continue
            with contextlib.suppress(Exception):
                sock.sendto(self._dns_answer(query), client)
        sock.close()

    def _dns_answer(self, query: bytes) -> bytes:
        labels, offset = [], 12
        while query[offset]:
            length = query[offset]
            labels.append(query[offset + 1:offset + 1 + length].decode())
            offset += 1 + length
        qtype = int.from_bytes(query[offset + 1:offset + 3], "big")
        question = query[12:offset + 5]
        name = ".".join(labels)
        found = self.addresses(name)
        records = found if qtype == 1 else []  # A records; a known name has no AAAA (NOERROR, empty)
        flags = 0x8180 if found else 0x8183  # NOERROR / NXDOMAIN
        header = query[:2] + flags.to_bytes(2, "big") + (1).to_bytes(2, "big") + len(records).to_bytes(2, "big")
        answers = b"".join(b"\xc0\x0c" + (1).to_bytes(2, "big") + (1).to_bytes(2, "big") + (1).to_bytes(4, "big")
                           + (4).to_bytes(2, "big") + socket.inet_aton(ip) for ip in records)
        return header + b"\x00\x00\x00\x00" + question + answers
