"""The rehearsal cluster's state (cluster.py puts it to work): its objects, pods, workloads, Services,
threads and events, shared by the layers built on it (dns.py, api_server.py, port_forwards.py,
kubelet.py, cluster.py), each of which uses only those below it."""

from __future__ import annotations

import base64
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rehearsal.netns import (
    HomeThread,
    Host,
    Network,
    enter_netns,
)
from rehearsal.network_policy import NetworkPolicies, Peer
from rehearsal.pods import NAMESPACE, Pod, ServiceEntry, Workload
from rehearsal.rbac import Authorizer
from rehearsal.rbac import Request as ApiRequest

if TYPE_CHECKING:
    from rehearsal.oci_images import Image


class ClusterState:
    def __init__(self, objects: list[dict[str, Any]], workdir: Path, link: tuple[float, float] | None = None,
                 images: dict[str, Image] | None = None) -> None:
        self.objects = objects
        self.workdir = workdir
        self.images = images or {}  # image reference as a manifest names it -> the image it runs from
        self.link = link  # (Mbit/s, ms): every pod's link shaped so (netns.Network.shape); None: veth speed
        # what the node declares of the extended resources pods ask for (a device plugin's nvidia.com/gpu):
        # a pod that does not fit is not started ("FailedScheduling"); CPU and memory are this machine's
        self.node_resources: dict[str, int] = {}
        self.policies = NetworkPolicies(objects, NAMESPACE)
        self._rulesets: dict[str, str] = {}  # pod netns -> the nftables rules applied there
        self._outside_peers: dict[str, Peer] = {}  # add_outside's hosts: pods no workload owns
        self._policy_lock = threading.Lock()
        self.network = Network()
        self.lock = threading.RLock()
        self.workloads: dict[str, Workload] = {}
        self.pods: list[Pod] = []
        self.services: dict[str, ServiceEntry] = {}
        self.events: list[tuple[float, str, str]] = []
        self.created_dirs: list[Path] = []
        self._clusterip_choice: dict[str, str] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._servers: list[socketserver.BaseServer] = []
        self._home: HomeThread | None = None  # gRPC calls and forks of the namespaced threads (see HomeThread)
        self._grpc_kept: Any = None
        self.control: Host | None = None
        self.api_certificate: tuple[bytes, bytes] = (b"", b"")  # the API server's, made with the control host
        self.socket_dir = Path(f"/tmp/{self.network.prefix}-sockets")
        self.api_port = 6443  # the API server as the pods and kubectl see it: authentication and RBAC
        self.store_port = 6442  # kmock itself, on the control host's loopback (KubeRay's stand-in calls it)
        self.authorizer = Authorizer(objects)
        self.api_requests: list[ApiRequest] = []  # every request the API server was asked, by whom
        self.kuberay: Any = None
        self.secrets = {
            o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in (o.get("data") or {}).items()}
            for o in objects
            if o["kind"] == "Secret"
        }
        self.config_maps = {o["metadata"]["name"]: o.get("data") or {} for o in objects if o["kind"] == "ConfigMap"}

    def _run_in_control(self, target: Callable[[], None], name: str) -> None:
        assert self.control is not None
        netns_path = Path("/var/run/netns") / self.control.netns

        def run() -> None:
            enter_netns(netns_path)
            target()

        thread = threading.Thread(target=run, name=f"rehearsal-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def event(self, kind: str, what: str) -> None:
        with self.lock:
            self.events.append((time.monotonic(), kind, what))

    def pods_of(self, owner: str, include_ended: bool = False) -> list[Pod]:
        with self.lock:
            return [p for p in self.pods if p.owner == owner and (include_ended or
                                                                  (not p.deleting and p.phase != "Terminated"))]

    def pod(self, owner: str) -> Pod:
        pods = self.pods_of(owner)
        assert pods, f"no pod of {owner}"
        return pods[0]
