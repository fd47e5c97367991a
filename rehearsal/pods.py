"""The objects of the rehearsal cluster: pods, their templates, volumes and security, workloads and
Services, and where a pod's image comes from (cluster.py runs them)."""

from __future__ import annotations

import contextlib
import json
import random
import string
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rehearsal.netns import (
    Host,
)

if TYPE_CHECKING:
    from rehearsal.oci_images import Image


REPO = Path(__file__).resolve().parents[1]


VENV_BIN = Path(sys.executable).parent


# Without images, what a pod's image holds is taken from this machine: the code and its venv. A volume
# mounted over them (the chart's emptyDir at /tmp, with a checkout under /tmp) must not hide them.
_IMAGE = {REPO, VENV_BIN.parent, Path(sys.base_prefix).resolve()}  # the venv's interpreter is in the image too


IMAGE_PATHS = sorted(p for p in _IMAGE if not any(p != q and p.is_relative_to(q) for q in _IMAGE))


def closed_ancestor(path: Path) -> Path | None:
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


def image_user(image: Image) -> tuple[int, int, bool]:
    """The image's USER as (uid, gid, numeric): no USER is root; a name is looked up in /etc/passwd."""
    user, _, group = image.config.user.partition(":")
    users = image.passwd()
    if not user:
        return 0, 0, True
    if user.isdigit():
        uid = int(user)
        default_gid = next((g for u, g, _ in users.values() if u == uid), 0)
        return uid, int(group) if group.isdigit() else default_gid, True
    if user not in users:
        raise ValueError(f"image {image.reference}: USER {user} is not in its /etc/passwd")
    uid, gid, _ = users[user]
    return uid, int(group) if group.isdigit() else gid, False


def home_of(image: Image, uid: int) -> str:
    return next((home for u, _, home in image.passwd().values() if u == uid), "/")


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


def quantity(value: Any) -> float:
    """A Kubernetes quantity ("500m", "2Gi", 1) as a number."""
    text = str(value)
    suffixes = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def probe_of(probe: dict[str, Any], ports: dict[str, int]) -> tuple[str, int, str] | None:
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
