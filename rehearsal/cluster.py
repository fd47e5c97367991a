"""The rehearsal cluster: the rendered chart run as pods on one machine.

What Kubernetes would do, done here, and nothing more:

- **pods**: each a process tree in namespaces of its own (:mod:`rehearsal.netns`), started with
  its container's command, arguments and environment exactly as rendered, merged with its image's
  config (see **images**; without images, the ENTRYPOINT of `docker/*.Dockerfile`); Secrets (env and volumes:
  each pod's identity certificate, Redis' password, the S3 keys, KubeRay's Ray token), fieldRefs and
  ConfigMap volumes resolved; emptyDirs fresh directories (tmpfs for `medium: Memory`), gone with
  the pod; a StatefulSet's volume claims directories that outlive their pods. A deleted pod runs
  its preStop hook, gets SIGTERM on its PID 1, and SIGKILL after its grace period; a killed one
  gets SIGKILL at once. A container that exits is restarted (restartPolicy Always), its emptyDirs
  kept, as the kubelet does.
- **controllers**: Deployments and StatefulSets keep their replica count (a deleted pod comes back
  with a new address); the bucket Job runs once.
- **cluster DNS**: a DNS server on the control host (every pod's resolv.conf, with the cluster's
  search domains) answers for Services with their ready pods (readiness from the rendered probe:
  a plaintext gRPC health check on the health-only port, as the kubelet's, the HTTP path for
  httpGet ones, a TCP connect for exec ones): a ClusterIP name with one ready
  pod, a headless one with all of them; /etc/hosts holds only the pod's own name.
- **the API server** is kmock (:mod:`rehearsal.kube_api`) in the control namespace behind
  an HTTPS front that authenticates bearer tokens and authorizes each request with the chart's RBAC
  (:mod:`rehearsal.rbac`); the run-controller pod (the rendered Deployment) calls it with a token
  of its ServiceAccount (in a kubeconfig); kubectl runs in the control namespace as an admin.
- **security**: each container runs as its securityContext says (uid, gid, fsGroup, capabilities,
  no new privileges, read-only root), its volumes owned as the kubelet owns them (`Security`);
- **NetworkPolicies** are enforced in each pod's namespace, and Services' port -> targetPort
  rewritten (:mod:`rehearsal.network_policy`);
- **KubeRay** (:mod:`rehearsal.kuberay`) turns the controller's RayJobs into a RayCluster (head
  and worker pods started as KubeRay starts them) and a submitter pod running KubeRay's own
  `ray job submit` command, and follows the job as KubeRay does.

- **images**: with `images` (reference -> :class:`rehearsal.oci_images.Image`, built by `make
  rehearsal-images`), each pod runs from the image its manifest names: the image's root filesystem
  under a writable layer of the container's own, its entrypoint, cmd, env, working directory and
  user merged with the container spec as the kubelet merges them (:mod:`rehearsal.container`).
  The chart's third-party images are stood in for by images built here: Redis by Debian's
  redis-server, SeaweedFS by moto's S3 server with its requests recorded on the pod's volume
  (:mod:`rehearsal.s3_pod`; it does not check the S3 keys it is given). A pod whose image is not
  in `images` runs on this machine's root filesystem, the Python ones from this checkout's virtual
  environment (both rehearsals, :mod:`rehearsal.training_rehearsal` and
  :mod:`rehearsal.scale_rehearsal`, give every pod its image).

Not enforced: resource limits.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import socketserver
import string
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rehearsal.container import enter_argv, home_of, image_user, process_of, root_commands
from rehearsal.netns import (
    HomeThread,
    Host,
    Network,
    enter_netns,
    grpc_threads_started,
    thread_namespaces,
    wait_until,
)
from rehearsal.network_policy import NetworkPolicies, Peer
from rehearsal.rbac import ADMIN, Authorizer, serving_certificate
from rehearsal.rbac import Request as ApiRequest
from rehearsal.rbac import serve as serve_rbac

if TYPE_CHECKING:
    from rehearsal.oci_images import Image

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# Without images, what a pod's image holds is taken from this machine: the code and its venv. A volume
# mounted over them (the chart's emptyDir at /tmp, with a checkout under /tmp) must not hide them.
_IMAGE = {REPO, VENV_BIN.parent, Path(sys.base_prefix).resolve()}  # the venv's interpreter is in the image too
IMAGE_PATHS = sorted(p for p in _IMAGE if not any(p != q and p.is_relative_to(q) for q in _IMAGE))


def _closed_ancestor(path: Path) -> Path | None:
    """The outermost directory above `path` that a user other than root cannot enter (pyenv's Python
    under /root, say): a pod must see the image, so the pod gets an open directory there instead."""
    for ancestor in reversed(path.parents):
        if ancestor != Path("/") and not ancestor.stat().st_mode & 0o001:
            return ancestor
    return None
NAMESPACE = "rl"
RELEASE = "overworld"
DOMAIN = f"{NAMESPACE}.svc.cluster.local"
SHM_SIZE = "1g"
SERVICE_IMAGE_ENTRYPOINTS = {
    "overworld-services": ("services.Dockerfile", None),
    "overworld-rollout-worker": ("rollout-worker.Dockerfile", "runtime"),
}
OBJECT_STORE_IMAGE = "chrislusf/seaweedfs"
POD_IP = "\x00status.podIP"  # a fieldRef to the pod's IP in a template's environment, filled in at its start


def image_entrypoint(dockerfile: Path, target: str | None = None) -> list[str]:
    """ENTRYPOINT of a Dockerfile's stage (the last one when no target is named)."""
    from dockerfile_parse import DockerfileParser

    entrypoint: list[str] = []
    stage = None
    for instruction in DockerfileParser(str(dockerfile)).structure:
        if instruction["instruction"] == "FROM":
            stage = instruction["value"].split()[-1] if " AS " in instruction["value"].upper() else None
            if target is not None and stage == target:
                entrypoint = []
        elif instruction["instruction"] == "ENTRYPOINT" and (target is None or stage == target):
            entrypoint = json.loads(instruction["value"])
    return entrypoint


def dockerfile_entrypoint(image: str) -> list[str]:
    for repository, (dockerfile, target) in SERVICE_IMAGE_ENTRYPOINTS.items():
        if f"/{repository}" in image:
            return image_entrypoint(REPO / "docker" / dockerfile, target)
    return []


def random_suffix(length: int = 5) -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=length))


@dataclass(frozen=True)
class Timing:
    """When the kubelet runs a probe and how many failures in a row it takes."""

    period: float = 10.0
    failures: int = 3
    delay: float = 0.0
    timeout: float = 1.0

    @classmethod
    def of(cls, probe: dict[str, Any]) -> Timing:
        return cls(float(probe.get("periodSeconds", 10)), int(probe.get("failureThreshold", 3)),
                   float(probe.get("initialDelaySeconds", 0)), float(probe.get("timeoutSeconds", 1)))


@dataclass(frozen=True)
class Security:
    """What the kubelet and the runtime make of a container's securityContext, its pod's and its
    image's USER: who the process is, and what it may do."""

    uid: int = 0
    gid: int = 0
    groups: tuple[int, ...] = ()  # supplementalGroups and fsGroup
    fs_group: int | None = None
    run_as_non_root: bool = False
    user_verifiable: bool = True  # False: the image's USER is a name, which runAsNonRoot cannot check
    read_only_root: bool = False
    drop_all_capabilities: bool = False
    no_new_privileges: bool = False

    def setpriv(self) -> list[str]:
        """The argv prefix that starts a process as this container does (empty: as root, all caps)."""
        if self.uid == 0 and self.gid == 0 and not self.drop_all_capabilities and not self.no_new_privileges:
            return []
        argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}"]
        argv.append(f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups")
        if self.drop_all_capabilities or self.uid != 0:
            argv += ["--inh-caps=-all", "--bounding-set=-all"]
        if self.no_new_privileges:
            argv.append("--no-new-privs")
        return [*argv, "--"]


def dockerfile_user(image: str) -> tuple[int, int]:
    """The USER (uid, gid) of one of this project's images, from its Dockerfile; (0, 0) otherwise."""
    from dockerfile_parse import DockerfileParser

    for repository, (dockerfile, target) in SERVICE_IMAGE_ENTRYPOINTS.items():
        if f"/{repository}" not in image:
            continue
        user, stage = "0", None
        for instruction in DockerfileParser(str(REPO / "docker" / dockerfile)).structure:
            if instruction["instruction"] == "FROM":
                stage = instruction["value"].split()[-1] if " AS " in instruction["value"].upper() else None
            elif instruction["instruction"] == "USER" and (target is None or stage == target):
                user = instruction["value"]
        uid, _, gid = user.partition(":")
        return int(uid), int(gid or uid)
    return 0, 0


def security_of(pod_spec: dict[str, Any], container: dict[str, Any], image: Image | None = None) -> Security:
    """The container's securityContext over its pod's, over the image's USER (from its config when the
    image is given, else from this project's Dockerfiles)."""
    pod = pod_spec.get("securityContext") or {}
    own = container.get("securityContext") or {}
    if image is not None:
        image_uid, image_gid, numeric = image_user(image)
    else:
        (image_uid, image_gid), numeric = dockerfile_user(container.get("image", "")), True
    uid = int(own.get("runAsUser", pod.get("runAsUser", image_uid)))
    gid = int(own.get("runAsGroup", pod.get("runAsGroup", image_gid if "runAsUser" not in own | pod else 0)))
    fs_group = pod.get("fsGroup")
    groups = tuple(dict.fromkeys([*(int(g) for g in pod.get("supplementalGroups") or []),
                                  *([int(fs_group)] if fs_group is not None else [])]))
    return Security(uid=uid, gid=gid, groups=groups, fs_group=None if fs_group is None else int(fs_group),
                    run_as_non_root=bool(own.get("runAsNonRoot", pod.get("runAsNonRoot", False))),
                    user_verifiable=numeric or "runAsUser" in own | pod,
                    read_only_root=bool(own.get("readOnlyRootFilesystem", False)),
                    drop_all_capabilities="ALL" in ((own.get("capabilities") or {}).get("drop") or []),
                    no_new_privileges=own.get("allowPrivilegeEscalation") is False)


def run_as_non_root_refusal(security: Security) -> str:
    """Why the kubelet refuses to start a container with `runAsNonRoot` ("" when it does not)."""
    if not security.run_as_non_root:
        return ""
    if security.uid == 0:
        return "container has runAsNonRoot and image will run as root"
    if not security.user_verifiable:
        return "container has runAsNonRoot and image has non-numeric user, cannot verify user is non-root"
    return ""


@dataclass
class Volume:
    mount_path: str
    kind: str  # "dir" (emptyDir, claim, ConfigMap or Secret files) or "memory" (tmpfs)
    source: Path | None = None
    read_only: bool = False


@dataclass
class PodTemplate:
    """What a pod is made of, resolved from a pod spec (everything but its address)."""

    labels: dict[str, str]
    argv: list[str]
    env: dict[str, str]
    volumes: list[Volume]
    grace: float = 30.0
    restart: str = "Always"
    pre_stop: list[str] | None = None
    readiness: tuple[str, int, str] | None = None  # ("tcp"|"http"|"grpc", port, path or gRPC service)
    env_from_pod: Callable[[Pod], dict[str, str]] | None = None
    claims: dict[str, str] = field(default_factory=dict)  # volume name -> claim directory key
    security: Security = field(default_factory=Security)
    ports: dict[str, int] = field(default_factory=dict)  # container ports by name
    readiness_timing: Timing = field(default_factory=Timing)
    liveness: tuple[str, int, str] | None = None  # as readiness: a container that fails it is restarted
    liveness_timing: Timing = field(default_factory=Timing)
    startup: tuple[str, int, str] | None = None  # until it succeeds, neither readiness nor liveness runs
    startup_timing: Timing = field(default_factory=Timing)
    extended: dict[str, int] = field(default_factory=dict)  # extended resources it asks for (nvidia.com/gpu)
    image: Image | None = None  # what it runs from; None: this machine's root filesystem
    workdir: str = "/"
    container: str = ""  # the container's name


@dataclass
class Pod:
    name: str
    owner: str
    template: PodTemplate
    host: Host
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    deleting: bool = False
    phase: str = "Pending"  # Running | Succeeded | Failed | Terminated
    exit_code: int | None = None
    restarts: int = 0
    started: float = 0.0
    ended: float = 0.0
    next_restart: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    probed: dict[str, float] = field(default_factory=dict)  # readiness | liveness -> when last run
    failed: dict[str, int] = field(default_factory=dict)  # consecutive failures

    @property
    def ip(self) -> str:
        return self.host.address

    @property
    def log(self) -> Path:
        return self.root / "log.txt"

    def pid1(self) -> int | None:
        """Host pid of the container's PID 1 (the child of `unshare --fork`)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError):
            pids = children.read_text().split()
            if pids:
                return int(pids[0])
        return None


@dataclass
class Workload:
    name: str
    kind: str  # Deployment | StatefulSet | Job | RayHead | RayWorkers | Submitter
    template: PodTemplate
    replicas: int
    owner: str = ""  # a RayJob's name for KubeRay's pods
    attempts: int = 0  # pods a Job has started


@dataclass
class ServiceEntry:
    name: str
    selector: dict[str, str]
    headless: bool


class Cluster:
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

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        self.network.create()
        self._home = HomeThread("rehearsal-home")
        # gRPC's threads up for as long as the cluster, as when an earlier test left a channel open: a
        # gRPC call or a fork from a namespaced thread then moves them every time, and stop() says so.
        self._grpc_kept = self._home.call(grpc_threads_started, timeout=30)
        self.control = self.network.add_host("control")
        self.api_certificate = serving_certificate([self.control.address, "127.0.0.1"])
        self._run_in_control(self._serve_api, "apiserver")
        self._run_in_control(self._serve_dns, "dns")
        wait_until(lambda: self._api_up(), 30, "the API server")
        for obj in self.objects:
            if obj["kind"] == "Service":
                self.add_service(obj["metadata"]["name"], obj["spec"].get("selector") or {},
                                 obj["spec"].get("clusterIP") == "None")
        self._run_in_control(self._reconcile_loop, "controllers")

    def stop(self) -> None:
        """Kill every pod, remove every namespace, link and file the cluster made; safe to call twice."""
        self._stop.set()
        try:
            for server in self._servers:
                server.shutdown()
            with self.lock:
                pods = list(self.pods)
            for pod in pods:
                self._kill(pod)
            for thread in self._threads:
                thread.join(timeout=5)
            if self._home is not None:
                self._home.close()
        finally:
            self.network.destroy()
            for path in reversed(self.created_dirs):
                with contextlib.suppress(OSError):
                    path.rmdir()
        for sock in self.socket_dir.glob("*.sock"):
            sock.unlink()
        with contextlib.suppress(OSError):
            self.socket_dir.rmdir()
        # Python's own threads (ours, the relays') end with their sockets; a native thread left in a
        # namespace (gRPC's pool) would send this process's later connections into one that is gone.
        python_threads = {thread.native_id for thread in threading.enumerate()}
        namespaces = thread_namespaces()
        home = namespaces[threading.get_native_id()]
        strays = {tid: ns for tid, ns in namespaces.items() if ns != home and tid not in python_threads}
        if self._grpc_kept is not None:
            self._grpc_kept.close()
            self._grpc_kept = None
        if strays:
            raise RuntimeError(f"native threads left in a rehearsal namespace (see netns.HomeThread): {strays}")

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

    # --- the API server (kmock) in the control namespace -----------------------------------------

    def _serve_api(self) -> None:
        import asyncio

        from rehearsal.api_validation import Validator
        from rehearsal.chart import chart_crds
        from rehearsal.kube_api import kubernetes_api

        async def serve() -> None:
            async with kubernetes_api(NAMESPACE, host="127.0.0.1", port=self.store_port) as (_, url):
                await serve_rbac(self.authorizer, url.rstrip("/"), "0.0.0.0", self.api_port, self.api_requests,
                                 self._stop, self.api_certificate, Validator(chart_crds()))

        asyncio.run(serve())

    def _api_up(self) -> bool:
        assert self.control is not None
        out = subprocess.run(["ip", "netns", "exec", self.control.netns, "python3", "-c",
                              f"import socket; socket.create_connection(('127.0.0.1', {self.api_port}), 1)"],
                             capture_output=True, timeout=10)
        return out.returncode == 0

    def api(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        """A request to the API server; only from the control namespace (the controllers' thread)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://127.0.0.1:{self.store_port}{path}", data=data, method=method,
                                         headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else {}

    def kubeconfig(self, server_host: str, user: str = ADMIN, path: Path | None = None) -> Path:
        """A kubeconfig for `user` (a person: everything; a ServiceAccount,
        `system:serviceaccount:<namespace>:<name>`: what its bindings grant) with a token of its own."""
        from rehearsal.kube_api import write_kubeconfig

        path = path or self.workdir / f"kubeconfig-{server_host}-{user.replace(':', '-')}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_kubeconfig(path, f"https://{server_host}:{self.api_port}", NAMESPACE,
                                token=self.authorizer.token_for(user), ca_pem=self.api_certificate[0])

    def service_account_kubeconfig(self, pod_spec: dict[str, Any]) -> Path | None:
        """What the kubelet gives a pod to reach the API server: a token of its ServiceAccount (as a
        kubeconfig here, alone in its directory: the pod mounts that) when the ServiceAccount exists and
        its token is mounted (the pod's `automountServiceAccountToken`, else the ServiceAccount's); None
        otherwise."""
        name = pod_spec.get("serviceAccountName", "default")
        accounts = {o["metadata"]["name"]: o for o in self.objects if o["kind"] == "ServiceAccount"}
        if name not in accounts:
            return None
        mounted = pod_spec.get("automountServiceAccountToken", accounts[name].get("automountServiceAccountToken", True))
        if not mounted:
            return None
        assert self.control is not None
        return self.kubeconfig(self.control.address, user=f"system:serviceaccount:{NAMESPACE}:{name}",
                               path=self.workdir / "serviceaccounts" / name / "kubeconfig")

    def kubectl_as(self, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        """kubectl in the control namespace with a token of `user` (a ServiceAccount:
        `system:serviceaccount:<namespace>:<name>`)."""
        from rehearsal.kube_api import kubectl

        assert self.control is not None
        return subprocess.run(["ip", "netns", "exec", self.control.netns, kubectl(), "--kubeconfig",
                               str(self.kubeconfig("127.0.0.1", user=user)), "--request-timeout=10s", *args],
                              capture_output=True, text=True, timeout=60)

    def kubectl(self, *args: str, check: bool = True) -> str:
        result = self.kubectl_as(ADMIN, *args)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        return result.stdout

    # --- port forwarding (like `kubectl port-forward`), for the test's own gRPC and HTTP calls ---

    def forward(self, target: str, port: int) -> str:
        """A Unix socket in this machine's filesystem that reaches `target:port` inside the cluster
        (a Service name, or a pod IP); returns the gRPC target `unix:PATH`."""
        path = self.socket_dir / f"{target[:60]}-{port}.sock"  # AF_UNIX paths are short
        if path.exists():
            return f"unix:{path}"
        cluster = self

        class Relay(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                address = cluster.resolve(target)
                if address is None:
                    return
                try:
                    upstream = socket.create_connection((address, port), timeout=5)
                except OSError:
                    return
                upstream.settimeout(None)
                pipes = [threading.Thread(target=_pipe, args=(self.request, upstream), daemon=True),
                         threading.Thread(target=_pipe, args=(upstream, self.request), daemon=True)]
                for pipe in pipes:
                    pipe.start()
                for pipe in pipes:
                    pipe.join()

        server = socketserver.ThreadingUnixStreamServer(str(path), Relay)
        server.daemon_threads = True
        self._servers.append(server)
        self._run_in_control(server.serve_forever, f"forward-{target}")
        return f"unix:{path}"

    # --- Services ------------------------------------------------------------------------------

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

    # --- workloads -----------------------------------------------------------------------------

    def wait_ready(self, owners: tuple[str, ...], timeout: float) -> None:
        """Every pod of each owner ready (and at least one each), or an AssertionError with the logs."""
        def ready() -> bool:
            return all(self.pods_of(o) and all(p.ready for p in self.pods_of(o)) for o in owners)

        try:
            wait_until(ready, timeout, f"pods of {owners} ready")
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{self.logs(tail=2000)}") from err

    def start_release(self, stores: tuple[str, ...], services: tuple[str, ...], timeout: float = 180) -> dict[str, Any]:
        """The rendered release in the order a cluster settles into anyway: the stores, then the bucket
        Job (the post-install hook) and the services. Returns the Deployments and StatefulSets by name."""
        workloads = {o["metadata"]["name"]: o for o in self.objects if o["kind"] in ("Deployment", "StatefulSet")}
        for name in stores:
            self.add_workload(self.workload_from_manifest(workloads[name]))
        self.wait_ready(stores, timeout)
        (job,) = [o for o in self.objects if o["kind"] == "Job"]
        self.add_workload(self.workload_from_manifest(job))
        for name in services:
            self.add_workload(self.workload_from_manifest(workloads[name]))
        self.wait_ready(services, timeout)
        wait_until(lambda: any(p.phase == "Succeeded" for p in self.pods_of(job["metadata"]["name"], True)),
                   timeout, "the bucket Job")
        return workloads

    def add_workload(self, workload: Workload) -> None:
        with self.lock:
            self.workloads[workload.name] = workload

    def scale(self, name: str, replicas: int) -> None:
        """`kubectl scale`: the controller starts new pods, or deletes the newest (a StatefulSet:
        the highest ordinals) gracefully."""
        with self.lock:
            workload = self.workloads[name]
            workload.replicas = replicas
            live = sorted(self.pods_of(name), key=lambda p: (p.name if workload.kind == "StatefulSet" else p.started))
        for pod in live[replicas:]:
            self.delete_pod(pod, graceful=True, wait=False)

    def remove_workload(self, name: str, graceful: bool = True) -> list[threading.Thread]:
        with self.lock:
            self.workloads.pop(name, None)
            pods = self.pods_of(name)
        return [self.delete_pod(pod, graceful=graceful, wait=False) for pod in pods]

    def pods_of(self, owner: str, include_ended: bool = False) -> list[Pod]:
        with self.lock:
            return [p for p in self.pods if p.owner == owner and (include_ended or
                                                                  (not p.deleting and p.phase != "Terminated"))]

    def pod(self, owner: str) -> Pod:
        pods = self.pods_of(owner)
        assert pods, f"no pod of {owner}"
        return pods[0]

    # --- pods ----------------------------------------------------------------------------------

    def unschedulable(self, template: PodTemplate) -> str:
        """Why the scheduler would leave a pod of `template` Pending ("" if it fits the node)."""
        with self.lock:
            placed = [p for p in self.pods if p.phase in ("Pending", "Running")]  # terminating ones hold theirs
        short = [name for name, asked in template.extended.items()
                 if asked + sum(p.template.extended.get(name, 0) for p in placed) > self.node_resources.get(name, 0)]
        return f"0/1 nodes are available: 1 Insufficient {', '.join(short)}." if short else ""

    def _start_pod(self, workload: Workload, ordinal: int | None = None) -> Pod | None:
        why = self.unschedulable(workload.template)
        if why:
            with self.lock:
                repeated = any(kind == "FailedScheduling" and what.startswith(f"{workload.name}: ")
                               for _, kind, what in self.events[-50:])
            if not repeated:
                self.event("FailedScheduling", f"{workload.name}: {why}")
            return None
        name = f"{workload.name}-{ordinal}" if ordinal is not None else f"{workload.name}-{random_suffix()}"
        host = self.network.add_host(name[:40])
        if self.link is not None:
            self.network.shape(host, *self.link)
        assert self.control is not None
        (host.hosts_file.parent / "resolv.conf").write_text(
            f"nameserver {self.control.address}\nsearch {DOMAIN} svc.cluster.local cluster.local\noptions ndots:5\n")
        root = self.workdir / "pods" / f"{name}-{host.address}"
        root.mkdir(parents=True)
        pod = Pod(name, workload.name, workload.template, host, root)
        with self.lock:
            self.pods.append(pod)
        self._enforce_policies([pod])  # isolated before its first packet, as the CNI sets a pod up
        self._launch(pod)
        self.event("pod-start", name)
        return pod

    def _launch(self, pod: Pod) -> None:
        template = pod.template
        security = template.security
        refusal = run_as_non_root_refusal(security)
        if refusal:
            # the kubelet's CreateContainerConfigError: the container never starts, the pod waits
            self.event("CreateContainerConfigError", f"{pod.name}: {refusal}")
            pod.phase, pod.ready = "Pending", False
            return
        if template.image is not None:
            self._start_process(pod, self._root_script(pod, template.image))
            return
        mounts, read_only, writable = [], [], []
        if security.uid != 0:  # the image readable by the container's user: open what hides it
            for ancestor in sorted({a for p in IMAGE_PATHS if (a := _closed_ancestor(p)) is not None}):
                inside = [p for p in IMAGE_PATHS if p.is_relative_to(ancestor)]
                stages = [shlex.quote(str(pod.root / f"image-open-{k}")) for k in range(len(inside))]
                for image, stage in zip(inside, stages, strict=True):
                    mounts.append(f"mkdir -p {stage}; mount --bind {shlex.quote(str(image))} {stage}")
                mounts.append(f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(str(ancestor))}")
                for image, stage in zip(inside, stages, strict=True):
                    mounts.append(f"mkdir -p {shlex.quote(str(image))}; mount --bind {stage} {shlex.quote(str(image))}")
        # Parents before what is mounted inside them (/etc/overworld, then /etc/overworld/tls), as the
        # container runtime orders them, each mount point made inside what is mounted above it; /tmp
        # last; read-only once everything is mounted.
        ordered = sorted(template.volumes, key=lambda v: (v.mount_path == "/tmp", len(Path(v.mount_path).parts)))
        for index, volume in enumerate(ordered):
            target = Path(volume.mount_path)
            missing = [d for d in (target, *target.parents) if not d.exists()]
            if missing:  # mount points; removed again by stop()
                target.mkdir(parents=True)
                self.created_dirs.extend(reversed(missing))
            quoted = shlex.quote(str(target))
            hidden = [p for p in IMAGE_PATHS if p.is_relative_to(target) and p != target]
            stages = [shlex.quote(str(pod.root / f"image-{index}-{k}")) for k in range(len(hidden))]
            for image, stage in zip(hidden, stages, strict=True):  # reachable while the volume covers it
                mounts.append(f"mkdir -p {stage}; mount --bind {shlex.quote(str(image))} {stage}")
            group = security.fs_group
            if volume.kind == "memory":  # an emptyDir in memory: world-writable, the fsGroup's
                mounts.append(f"mount -t tmpfs -o size={SHM_SIZE},mode={'2777' if group is not None else '1777'}"
                              f"{f',gid={group}' if group is not None else ''} tmpfs {quoted}")
            else:
                source = self._volume_source(pod, index, volume)
                mounts.append(f"mkdir -p {quoted}; mount --bind {shlex.quote(str(source))} {quoted}")
            for image, stage in zip(hidden, stages, strict=True):  # back where the image has it
                mounts.append(f"mkdir -p {shlex.quote(str(image))}; mount --bind {stage} {shlex.quote(str(image))}")
            if volume.kind != "memory" and volume.read_only:
                read_only.append(f"mount -o remount,bind,ro {quoted}")
            else:
                writable.append(quoted)
        mounts += read_only
        if security.read_only_root:
            # every other mount read-only, as a container's root filesystem: what the pod may write is its
            # volumes (and /dev, /proc, /sys stay as they are)
            keep = "|".join(["/proc", "/proc/*", "/sys", "/sys/*", "/dev", "/dev/*", *writable])
            mounts.append(f"for m in $(awk '{{print $2}}' /proc/self/mounts); do case \"$m\" in {keep}) ;; "
                          f"*) mount -o remount,bind,ro \"$m\" 2>/dev/null || true;; esac; done")
            # a root that can still be written is this harness's failure, not the pod's: say so
            mounts.append("if touch /.owr-read-only-probe 2>/dev/null; then rm -f /.owr-read-only-probe; "
                          "echo 'rehearsal: the read-only root filesystem is not in force' >&2; exit 70; fi")
        run = " ".join(shlex.quote(a) for a in security.setpriv())
        self._start_process(pod, "; ".join(mounts) + f'; exec {run} "$@"', {
            "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH": f"{REPO / 'services'}:{REPO}",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "OVERWORLD_LOG_FORMAT": "text",
            "RAY_USAGE_STATS_ENABLED": "0",
        })

    def _root_script(self, pod: Pod, image: Image) -> str:
        """The commands that make the pod's root filesystem from its image (rehearsal.container),
        then exec the container's process as its securityContext says."""
        template = pod.template
        ordered = sorted(template.volumes, key=lambda v: len(Path(v.mount_path).parts))
        volumes = [replace(v, source=self._volume_source(pod, index, v)) if v.kind != "memory" else v
                   for index, v in enumerate(ordered)]
        hostname = pod.root / "hostname"
        hostname.write_text(f"{pod.name}\n")
        root = pod.root / "rootfs"
        commands = root_commands(image, root, pod.root / f"layer-{pod.restarts}", volumes, template.security, hostname)
        enter = " ".join(shlex.quote(a) for a in enter_argv("new", str(root), template.security, template.workdir))
        return "; ".join(commands) + f'; exec {enter} "$@"'

    def _volume_source(self, pod: Pod, index: int, volume: Volume) -> Path:
        """The directory behind a volume, owned as the kubelet owns it: an emptyDir world-writable and
        the fsGroup's, a claim handed to the fsGroup."""
        group = pod.template.security.fs_group
        source = volume.source or pod.root / f"volume-{index}"
        if volume.source is None:
            source.mkdir(parents=True, exist_ok=True)
            source.chmod(0o777)
            if group is not None:
                os.chown(source, 0, group)
                source.chmod(0o2777)
        elif group is not None and volume.kind == "dir" and not volume.read_only:
            _own_for_group(source, group)
        return source

    def _start_process(self, pod: Pod, script: str, base_env: dict[str, str] | None = None) -> None:
        """Run `script` (which execs the container's process) as PID 1 of the pod's namespaces."""
        template = pod.template
        env = {
            **(base_env or {}),
            "OWR_POD_NAME": pod.name,
            **{k: pod.ip if v == POD_IP else v for k, v in template.env.items()},
            **(template.env_from_pod(pod) if template.env_from_pod else {}),
        }
        pod.env = env
        script = 'set -e; hostname "$OWR_POD_NAME"; ' + script
        argv = ["ip", "netns", "exec", pod.host.netns, "unshare", "--pid", "--fork", "--kill-child",
                "--mount-proc", "--uts", "--propagation", "private", "/bin/sh", "-c", script, "sh",
                *template.argv]
        with pod.log.open("ab") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}: {shlex.join(template.argv)}\n".encode())
            log.flush()
            # If this harness dies (even by SIGKILL), the pod dies with it: PR_SET_PDEATHSIG, kept by
            # `ip netns exec` and `unshare`, which kills its PID namespace. Forked from the home
            # thread, which lives as long as the cluster: a fork from the controllers' thread would
            # restart gRPC's threads in the control namespace (netns.HomeThread).
            assert self._home is not None
            pod.proc = self._home.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd="/", start_new_session=True,
                                        preexec_fn=_die_with_parent)
        pod.phase = "Running"
        pod.ready = False
        pod.started = time.monotonic()
        pod.probed.clear()
        pod.failed.clear()

    def delete_pod(self, pod: Pod, graceful: bool = False, wait: bool = True) -> threading.Thread:
        """`kubectl delete pod` (graceful: preStop, SIGTERM, grace period) or a node loss (SIGKILL).
        Its disk goes with it; the workload's controller starts a new pod elsewhere."""
        with self.lock:
            if pod.deleting:
                thread = threading.Thread(target=lambda: None)
                thread.start()
                return thread
            pod.deleting = True
            pod.ready = False

        def run() -> None:
            if graceful:
                self._terminate(pod)
            self._kill(pod)
            self.network.remove_host(pod.host)
            self.event("pod-gone", pod.name)

        thread = threading.Thread(target=run, name=f"delete-{pod.name}", daemon=True)
        thread.start()
        if wait:
            thread.join()
        return thread

    def _terminate(self, pod: Pod) -> None:
        deadline = time.monotonic() + pod.template.grace
        pid1 = pod.pid1()
        if pid1 is None:
            return
        if pod.template.pre_stop:
            with pod.log.open("ab") as log:
                hook = subprocess.Popen([*self._enter(pod, pid1), *pod.template.pre_stop], env=pod.env, stdout=log,
                                        stderr=subprocess.STDOUT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                hook.wait(timeout=max(1.0, deadline - time.monotonic()))
            if hook.poll() is None:
                hook.kill()
                hook.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid1, signal.SIGTERM)
        assert pod.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.proc.wait(timeout=max(0.1, deadline - time.monotonic()))

    def _kill(self, pod: Pod) -> None:
        if pod.proc is not None and pod.proc.poll() is None:
            pod.proc.kill()  # unshare --kill-child: PID 1 and with it the whole PID namespace die
            pod.proc.wait()
        with self.lock:
            pod.phase = "Terminated"
            pod.ready = False
            pod.ended = time.monotonic()

    def exec(self, pod: Pod, *argv: str, timeout: float = 60) -> str:
        """`kubectl exec`: a command in the pod's namespaces (network, mounts, hosts file) and environment."""
        pid1 = pod.pid1()
        assert pid1 is not None, f"{pod.name} is not running"
        command = list(argv)
        if pod.template.image is None and argv[0] in ("python", "python3"):
            command[0] = sys.executable
        result = subprocess.run([*self._enter(pod, pid1), *command], env=pod.env, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"exec in {pod.name}: {result.stderr[-2000:]}"
        return result.stdout

    @staticmethod
    def _enter(pod: Pod, pid1: int) -> list[str]:
        """The argv prefix that runs a command in a running container (kubectl exec, a preStop hook): its
        namespaces, its root filesystem, its user."""
        security = pod.template.security
        if pod.template.image is None:
            return ["nsenter", "-t", str(pid1), "-a", *security.setpriv()]
        return ["nsenter", "-t", str(pid1), "-n", "-u", "-p", "--",
                *enter_argv("join", str(pid1), security, pod.template.workdir)]

    def http_get(self, target: str, port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
        """An HTTP GET to `target:port` in the cluster through a port-forward (from the node, which every
        NetworkPolicy lets in): (status, body)."""
        import http.client

        socket_path = self.forward(target, port).removeprefix("unix:")

        class UnixHTTP(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout)
                self.sock.connect(socket_path)

        connection = UnixHTTP("localhost", timeout=timeout)
        try:
            connection.request("GET", path)
            reply = connection.getresponse()
            return reply.status, reply.read()
        finally:
            connection.close()

    def scrape(self, pod: Pod, port: int = 9090) -> dict[str, float]:
        """A pod's Prometheus metrics, read through a port-forward: name{labels} -> value."""
        status, body = self.http_get(pod.ip, port, "/metrics")
        assert status == 200, f"{pod.name}:{port}/metrics answered {status}"
        out = body.decode()
        samples = {}
        for line in out.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    samples[name] = float(value)
        return samples

    def add_outside(self, label: str, namespace: str = NAMESPACE, labels: dict[str, str] | None = None) -> Host:
        """A host of its own on the pod network, with the cluster's DNS, that no workload owns: a pod of
        `namespace` carrying `labels`, as the NetworkPolicies see it (someone else's pod; a compromised
        pod of the release; a monitoring pod). Remove it with :meth:`remove_outside`."""
        host = self.network.add_host(label)
        assert self.control is not None
        with self.lock:
            self._outside_peers[host.netns] = Peer(host.address, dict(labels or {}), namespace, {})
        self._enforce_policies()
        (host.hosts_file.parent / "resolv.conf").write_text(
            f"nameserver {self.control.address}\nsearch {DOMAIN} svc.cluster.local cluster.local\noptions ndots:5\n")
        return host

    def remove_outside(self, host: Host) -> None:
        with self.lock:
            self._outside_peers.pop(host.netns, None)
        self.network.remove_host(host)  # kills what still runs in its namespace
        self._enforce_policies()

    OUTSIDE_ENV = {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "PYTHONPATH": f"{REPO / 'services'}:{REPO}", "HOME": "/tmp", "LANG": "C.UTF-8"}

    def popen_outside(self, host: Host, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        """Start a long-lived process on an outside host (this machine's programs, not an image's), its
        output appended to `log`; it dies with this harness (PR_SET_PDEATHSIG) or with its host."""
        assert self._home is not None
        with log.open("ab") as out:
            return self._home.popen(["ip", "netns", "exec", host.netns, *argv], env=self.OUTSIDE_ENV, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                    start_new_session=True, preexec_fn=_die_with_parent)

    def run_outside(self, label: str, argv: list[str], timeout: float = 120,
                    labels: dict[str, str] | None = None, namespace: str = NAMESPACE) -> str:
        """Run a command on an outside host (:meth:`add_outside`: a pod of `namespace` with `labels`);
        return its stdout. The host is removed afterwards."""
        host = self.add_outside(label, namespace, labels)
        try:
            result = subprocess.run(["ip", "netns", "exec", host.netns, *argv], env=self.OUTSIDE_ENV,
                                    capture_output=True, text=True, timeout=timeout, cwd=REPO)
        finally:
            self.remove_outside(host)
        assert result.returncode == 0, f"{shlex.join(argv)} on {label}: {result.stderr[-3000:]}"
        return result.stdout

    def freeze(self, pod: Pod, frozen: bool) -> None:
        """SIGSTOP / SIGCONT every process of a pod."""
        for line in subprocess.run(["ip", "netns", "pids", pod.host.netns], capture_output=True, text=True,
                                   check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line), signal.SIGSTOP if frozen else signal.SIGCONT)

    # --- the controllers' loop (in the control namespace) -----------------------------------------

    def _reconcile_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._kubelet()
                self._controllers()
                self._enforce_policies()
                self._probe_readiness()
                if self.kuberay is not None:
                    self.kuberay.reconcile()
            except Exception as err:  # keep the cluster running; the tests see the consequences
                print(f"rehearsal controller error: {err!r}", file=sys.stderr, flush=True)
            self._stop.wait(0.5)

    def _kubelet(self) -> None:
        now = time.monotonic()
        with self.lock:
            pods = [p for p in self.pods if not p.deleting and p.phase == "Running"]
        for pod in pods:
            if pod.proc is None or pod.proc.poll() is None:
                continue
            pod.exit_code = pod.proc.returncode
            pod.ready = False
            if pod.template.restart == "Always":
                if pod.next_restart == 0.0:
                    backoff = min(10.0 * 2 ** max(0, pod.restarts - 1), 60.0) if pod.restarts else 1.0
                    pod.next_restart = now + backoff
                elif now >= pod.next_restart:
                    pod.restarts += 1
                    pod.next_restart = 0.0
                    self.event("container-restart", pod.name)
                    self._launch(pod)
            else:
                with self.lock:
                    pod.phase = "Succeeded" if pod.exit_code == 0 else "Failed"
                    pod.ended = now

    def _controllers(self) -> None:
        with self.lock:
            workloads = list(self.workloads.values())
        for workload in workloads:
            live = self.pods_of(workload.name)
            if workload.kind == "StatefulSet":
                names = {p.name for p in live}
                for ordinal in range(workload.replicas):
                    if f"{workload.name}-{ordinal}" not in names:
                        self._start_pod(workload, ordinal)
            elif workload.kind in ("Job", "Submitter"):
                finished = [p for p in self.pods_of(workload.name, include_ended=True) if p.phase == "Succeeded"]
                running = [p for p in live if p.phase in ("Pending", "Running")]
                if not finished and not running and workload.attempts < workload.replicas:
                    workload.attempts += 1
                    self._start_pod(workload)
            else:
                for _ in range(workload.replicas - len(live)):
                    self._start_pod(workload)

    def _enforce_policies(self, only: list[Pod] | None = None) -> None:
        """Every pod's nftables rules as the NetworkPolicies say, given the pods there are now."""
        assert self.control is not None
        with self.lock:
            # a terminating pod still matches selectors until it is gone (its connections while it drains)
            pods = [p for p in self.pods if p.phase != "Terminated"]
            outside = list(self._outside_peers.values())
        peers = [*(Peer(p.ip, p.template.labels, NAMESPACE, p.template.ports) for p in pods), *outside]
        with self._policy_lock:
            self._apply_policies(only or pods, peers)

    def _apply_policies(self, pods: list[Pod], peers: list[Peer]) -> None:
        assert self.control is not None
        for pod in pods:
            ruleset = self.policies.ruleset(Peer(pod.ip, pod.template.labels, NAMESPACE, pod.template.ports), peers,
                                            self.control.address)
            if self._rulesets.get(pod.host.netns) != ruleset:
                try:
                    NetworkPolicies.apply(pod.host.netns, ruleset)
                except subprocess.CalledProcessError as err:  # a pod deleted meanwhile
                    if not pod.deleting:
                        raise RuntimeError(f"nft in {pod.name}: {err.stderr}\n{ruleset}") from err
                    continue
                self._rulesets[pod.host.netns] = ruleset

    def _probe_readiness(self) -> None:
        """The kubelet's probes. Startup first: until it succeeds (tried every 0.5 s here, for a quick
        rehearsal; `failureThreshold` x periodSeconds allowed, then the container is restarted) neither of
        the others runs. Readiness: a pod becomes ready at its first success (tried every 0.5 s until then)
        and unready after `failureThreshold` failures in a row (every periodSeconds); the DNS answers
        only with ready pods. Liveness (after initialDelaySeconds, every periodSeconds): `failureThreshold`
        failures in a row restart the container. Each probe waits its timeoutSeconds."""
        now = time.monotonic()
        with self.lock:
            pods = [p for p in self.pods if not p.deleting and p.phase == "Running"
                    and p.proc is not None and p.proc.poll() is None]
        for pod in pods:
            template = pod.template
            if template.startup is not None and not pod.probed.get("started"):
                if self._probe(pod, template.startup, template.startup_timing.timeout):
                    pod.probed["started"] = now
                elif now - pod.started > template.startup_timing.failures * template.startup_timing.period:
                    self._restart(pod, "startup probe failed")
                continue
            if template.readiness is None:
                pod.ready = True
            elif not pod.ready or now - pod.probed.get("readiness", 0.0) >= template.readiness_timing.period:
                pod.probed["readiness"] = now
                ok = self._probe(pod, template.readiness, template.readiness_timing.timeout)
                pod.failed["readiness"] = 0 if ok else pod.failed.get("readiness", 0) + 1
                if ok and not pod.ready:
                    pod.ready = True
                    self.event("pod-ready", pod.name)
                elif pod.ready and pod.failed["readiness"] >= template.readiness_timing.failures:
                    pod.ready = False
                    self.event("Unhealthy", f"{pod.name}: readiness probe failed {pod.failed['readiness']} times")
            timing = template.liveness_timing
            since = pod.probed.get("started", pod.started)
            if (template.liveness is not None and now - since >= timing.delay
                    and now - pod.probed.get("liveness", since) >= timing.period):
                pod.probed["liveness"] = now
                ok = self._probe(pod, template.liveness, timing.timeout)
                pod.failed["liveness"] = 0 if ok else pod.failed.get("liveness", 0) + 1
                if pod.failed["liveness"] >= timing.failures:
                    self._restart(pod, f"liveness probe failed {pod.failed['liveness']} times")

    def _restart(self, pod: Pod, why: str) -> None:
        """The kubelet killing a container for its probes: its preStop hook, SIGTERM, SIGKILL after the
        grace period; then the restart (restartPolicy Always) as for any container that exits."""
        self.event("Killing", f"{pod.name}: {why}, restarting the container")
        pod.ready = False
        def stop() -> None:
            self._terminate(pod)
            if pod.proc is not None and pod.proc.poll() is None:
                pod.proc.kill()  # the grace period is over

        threading.Thread(target=stop, name=f"restart-{pod.name}", daemon=True).start()

    def _probe(self, pod: Pod, probe: tuple[str, int, str], timeout: float = 1.0) -> bool:
        kind, port, path = probe
        try:
            if kind == "grpc":
                return self._grpc_serving(pod, port, path, timeout)
            if kind == "http":
                with urllib.request.urlopen(f"http://{pod.ip}:{port}{path}", timeout=timeout) as response:
                    return bool(response.status < 400)
            with socket.create_connection((pod.ip, port), timeout=timeout):
                return True
        except OSError:
            return False

    def _grpc_serving(self, pod: Pod, port: int, service: str, timeout: float = 1.0) -> bool:
        """The kubelet's gRPC probe: grpc.health.v1 Check, plaintext, no client certificate. Made on the
        home thread (netns.HomeThread), through a forward into the cluster."""
        import grpc

        from overworld.core.grpc_util import serving

        def check() -> bool:
            with grpc.insecure_channel(self.forward(pod.ip, port)) as channel:
                return serving(channel, service, timeout)

        assert self._home is not None
        return self._home.call(check, timeout=timeout + 10)

    # --- from rendered manifests -------------------------------------------------------------------

    def template_from_pod_spec(self, pod_spec: dict[str, Any], labels: dict[str, str],
                               claims: dict[str, Path] | None = None) -> PodTemplate:
        """A PodTemplate from a rendered pod spec: its first container, volumes, probe, hooks."""
        container = pod_spec["containers"][0]
        reference = container.get("image", "")
        image = self.images.get(reference)
        if OBJECT_STORE_IMAGE in reference:  # the stand-in's own program, on the chart's port and volume
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == "s3")
            arguments = ["--port", str(port), "--data", "/data"]
            container = {**container, "command": None if image else [sys.executable, str(REPO / "rehearsal" / "s3_pod.py")],
                         "args": arguments}
        env = self.container_env(container.get("env") or [])
        security = security_of(pod_spec, container, image)
        volumes = self._volumes(pod_spec, container, claims or {}, security.fs_group)
        pre_stop = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
        workdir = "/"
        if image is not None:
            process = process_of(container, image, env)
            argv, env, workdir = process.argv, process.env, process.workdir
            env.setdefault("HOME", home_of(image, security.uid))
        else:
            argv = [*(container.get("command") or dockerfile_entrypoint(reference)), *(container.get("args") or [])]
            if argv and argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            if pre_stop and pre_stop[0] in ("python", "python3"):
                pre_stop = [sys.executable, *pre_stop[1:]]
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        readiness = _probe_of(container.get("readinessProbe") or {}, ports)
        liveness = _probe_of(container.get("livenessProbe") or {}, ports)
        startup = _probe_of(container.get("startupProbe") or {}, ports)
        resources = container.get("resources") or {}
        extended = {k: int(quantity(v)) for k, v in {**(resources.get("requests") or {}),
                                                      **(resources.get("limits") or {})}.items() if "/" in k}
        return PodTemplate(labels=dict(labels), argv=argv, env=env, volumes=volumes,
                           grace=float(pod_spec.get("terminationGracePeriodSeconds", 30)),
                           restart=pod_spec.get("restartPolicy", "Always"), pre_stop=pre_stop,
                           readiness=readiness, security=security, ports=ports,
                           readiness_timing=Timing.of(container.get("readinessProbe") or {}), liveness=liveness,
                           liveness_timing=Timing.of(container.get("livenessProbe") or {}), extended=extended,
                           startup=startup, startup_timing=Timing.of(container.get("startupProbe") or {}),
                           image=image, workdir=workdir, container=container.get("name", ""))

    def container_env(self, items: list[dict[str, Any]]) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in items:
            if "valueFrom" in item:
                source = item["valueFrom"]
                if "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    env[item["name"]] = self.secrets[ref["name"]][ref["key"]]
                elif source.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                    env[item["name"]] = NAMESPACE
                elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                    env[item["name"]] = POD_IP  # the pod's address, known when it starts
                else:
                    raise NotImplementedError(f"env {item['name']}: {source}")
            else:
                env[item["name"]] = str(item.get("value", ""))
        return env

    def _volumes(self, pod_spec: dict[str, Any], container: dict[str, Any],
                 claims: dict[str, Path], fs_group: int | None = None) -> list[Volume]:
        declared = {v["name"]: v for v in pod_spec.get("volumes") or []}
        volumes = []
        for mount in container.get("volumeMounts") or []:
            name = mount["name"]
            volume = declared.get(name)
            if name in claims:
                volumes.append(Volume(mount["mountPath"], "dir", claims[name]))
            elif volume is not None and "configMap" in volume:
                source = self.workdir / "config-maps" / volume["configMap"]["name"]
                source.mkdir(parents=True, exist_ok=True)
                for key, text in self.config_maps[volume["configMap"]["name"]].items():
                    (source / key).write_text(text)
                volumes.append(Volume(mount["mountPath"], "dir", source, read_only=True))
            elif volume is not None and "secret" in volume:
                # Secret and ConfigMap volumes are read-only whatever the mount says (the kubelet's)
                volumes.append(Volume(mount["mountPath"], "dir", self._secret_files(volume["secret"], fs_group),
                                      read_only=True))
            elif volume is not None and (volume.get("emptyDir") or {}).get("medium") == "Memory":
                volumes.append(Volume(mount["mountPath"], "memory"))
            elif volume is not None and "emptyDir" in volume:
                volumes.append(Volume(mount["mountPath"], "dir"))
            else:
                raise NotImplementedError(f"volume {name}: {volume}")
        return volumes

    def _secret_files(self, source: dict[str, Any], fs_group: int | None) -> Path:
        """A Secret volume: one file per key with the volume's defaultMode, owned by root and, when the
        pod has an fsGroup, by that group (as the kubelet writes them)."""
        name = source["secretName"]
        directory = self.workdir / "secrets" / f"{name}-{'root' if fs_group is None else fs_group}"
        directory.mkdir(parents=True, exist_ok=True)
        for key, text in self.secrets[name].items():
            path = directory / key
            path.write_text(text)
            os.chown(path, 0, 0 if fs_group is None else fs_group)
            mode = int(source.get("defaultMode", 0o644))
            path.chmod(mode | (0o440 if fs_group is not None else 0))  # the kubelet lets the fsGroup read it
        return directory

    def workload_from_manifest(self, obj: dict[str, Any], replicas: int | None = None) -> Workload:
        spec = obj["spec"]
        template = spec["template"]
        claims: dict[str, Path] = {}
        for claim in spec.get("volumeClaimTemplates") or []:
            # One claim per StatefulSet (replicas 1 here): it outlives the pod, as a PVC does.
            claims[claim["metadata"]["name"]] = self.workdir / "claims" / f"{claim['metadata']['name']}-{obj['metadata']['name']}-0"
        pod_template = self.template_from_pod_spec(template["spec"], template["metadata"].get("labels") or {}, claims)
        count = replicas if replicas is not None else int(spec.get("replicas", 1) if obj["kind"] != "Job" else 1)
        if obj["kind"] == "Job":
            count = int(spec.get("backoffLimit", 6)) + 1
            pod_template.restart = "Never"
        return Workload(obj["metadata"]["name"], obj["kind"], pod_template, count)

    def logs(self, owner_prefix: str = "", tail: int = 3000) -> str:
        with self.lock:
            pods = [p for p in self.pods if p.owner.startswith(owner_prefix)]
        out = []
        for pod in pods:
            with contextlib.suppress(OSError):
                out.append(f"--- {pod.name} ({pod.ip}, {pod.phase}, exit {pod.exit_code}):\n"
                           f"{pod.log.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)


def quantity(value: Any) -> float:
    """A Kubernetes quantity ("500m", "2Gi", 1) as a number."""
    text = str(value)
    suffixes = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def _probe_of(probe: dict[str, Any], ports: dict[str, int]) -> tuple[str, int, str] | None:
    """A rendered probe as (kind, port, path or gRPC service); an exec probe is approximated by a TCP
    connect to the container's first port (its command would run inside the container)."""
    if "grpc" in probe:
        return ("grpc", int(probe["grpc"]["port"]), probe["grpc"].get("service", ""))
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        return ("http", int(ports.get(port, port)), probe["httpGet"].get("path", "/"))
    if "tcpSocket" in probe:
        port = probe["tcpSocket"]["port"]
        return ("tcp", int(ports.get(port, port)), "")
    if "exec" in probe and ports:
        return ("tcp", next(iter(ports.values())), "")
    return None


def _own_for_group(root: Path, group: int) -> None:
    """A volume handed to a pod's fsGroup, as the kubelet does: group-owned, group-writable, new files
    inheriting the group (setgid directories)."""
    root.mkdir(parents=True, exist_ok=True)
    for path in [root, *root.rglob("*")]:
        with contextlib.suppress(OSError):
            os.lchown(path, -1, group)
            if not path.is_symlink():
                mode = path.stat().st_mode
                path.chmod(mode | 0o060 | (0o2010 if path.is_dir() else 0))


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def running(cluster: Cluster) -> Iterator[Cluster]:
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
