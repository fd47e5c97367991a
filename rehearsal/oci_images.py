"""The images the tests run, built as a user builds them and read as a container runtime reads them.

`build()` runs `make rehearsal-images` (docker/images.mk: docker where its daemon answers, else
buildah; layers cached across runs) with the CPU-only torch, under names of their own so that a
user's CUDA images are left alone:

| role | reference |
|---|---|
| services, rollout-worker, trainer | localhost/overworld-rl/overworld-<role>:<version>-cpu |
| the chart's SeaweedFS and Redis, stood in for | localhost/overworld-rehearsal/{object-store,redis}:... |

`ImageStore` gives each image's config (entrypoint, cmd, env, working directory, user) and its root
filesystem (buildah: a working container of the image, mounted; docker: the image exported once into
a directory named by its id). `missing_prerequisites()` names what building and running them needs
that this machine lacks, and how to get it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docker"))
from pip_config_mounts import wheel_found_locally  # noqa: E402

VERSION = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), flags=re.M)[1]  # type: ignore[index]
REGISTRY = "localhost/overworld-rl"
TAG = f"{VERSION}-cpu"
ROLES = ("services", "rollout-worker", "trainer")
MOTO_VERSION = re.search(r'"moto\[server\]==([^"]+)"', (REPO / "pyproject.toml").read_text())[1]  # type: ignore[index]
OBJECT_STORE = f"localhost/overworld-rehearsal/object-store:moto-{MOTO_VERSION}"
REDIS = "localhost/overworld-rehearsal/redis:bookworm"
BASE = "docker.io/library/python:3.11-slim-bookworm"  # docker/build-image.sh's; a stand-in where it cannot be pulled
BUILD_TIMEOUT_SECONDS = 3600
CONTAINER_PREFIX = "owr-image"
DOCKER_ROOTS = Path("/var/tmp/overworld-image-roots")


def reference(role: str) -> str:
    return f"{REGISTRY}/overworld-{role}:{TAG}"


class ImageBuildFailed(RuntimeError):
    """`make rehearsal-images` (or another image target) failed; the message ends with its output's last lines."""


def builder() -> str | None:
    """The builder docker/build-image.sh picks: docker where its daemon answers, else buildah."""
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0:
        return "docker"
    return "buildah" if shutil.which("buildah") else None


def missing_prerequisites(images: bool, namespaces: bool) -> list[str]:
    """What building and running the images (`images`) and the tests made of network namespaces (the
    cluster rehearsal: `namespaces`) need that this machine lacks: "what (how to get it)" each."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (images are mounted and pods are namespaces: run as root, as CI does)")
    tools = {"unshare": "util-linux", "nsenter": "util-linux", "mount": "mount"}
    if images:
        kind = builder()
        if kind is None:
            missing.append("an image builder (Docker, or buildah: apt-get install buildah)")
        elif shutil.which("mmdebstrap") is None and not _base_available(kind):
            missing.append(f"mmdebstrap (apt-get install mmdebstrap: {BASE} cannot be pulled, and its stand-in is "
                           "built from Debian's packages)")
        tools["make"] = "make"
    if namespaces:
        tools |= {"ip": "iproute2", "nft": "nftables"}
    for tool, package in tools.items():
        if shutil.which(tool) is None:
            missing.append(f"{tool} (apt-get install {package})")
    return missing


def _base_available(kind: str) -> bool:
    """Whether the images' base is here or can be pulled."""
    for argv in ([kind, "image", "inspect", BASE] if kind == "docker" else ["buildah", "inspect", "--type", "image", BASE],
                 [kind, "pull", "-q", BASE]):
        try:
            if subprocess.run(argv, capture_output=True, timeout=300).returncode == 0:
                return True
        except subprocess.TimeoutExpired:
            return False
    return False


def _local_cpu_torch() -> bool:
    """Whether pip here finds PyTorch's CPU wheel without PyTorch's index (a local wheel directory)."""
    torch = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text())
    return torch is not None and wheel_found_locally(f"torch-{torch[1]}+cpu-*.whl")


def build(log: Path, target: str = "rehearsal-images") -> None:
    """`make rehearsal-images` (or `target`: `scale-images` for the scale rehearsal) with the CPU-only
    torch; its output goes to `log`."""
    command = ["make", "--no-print-directory", target, f"REGISTRY={REGISTRY}", f"TAG={TAG}",
               "TORCH_VARIANT=cpu"]
    if _local_cpu_torch():
        command.append("TORCH_CPU_INDEX_URL=")  # PyTorch's index is not reachable from every machine
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_SECONDS)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise ImageBuildFailed(f"`{' '.join(command)}` exited with {done.returncode} (log: {log}):\n" + "\n".join(tail))


@dataclass(frozen=True)
class ImageConfig:
    """The part of an OCI image config that decides how its containers start."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    user: str

    @classmethod
    def of(cls, config: dict[str, object]) -> ImageConfig:
        env = dict(item.split("=", 1) for item in (config.get("Env") or []))  # type: ignore[attr-defined]
        return cls(list(config.get("Entrypoint") or []), list(config.get("Cmd") or []),  # type: ignore[call-overload]
                   env, str(config.get("WorkingDir") or ""), str(config.get("User") or ""))


@dataclass(frozen=True)
class Image:
    reference: str
    config: ImageConfig
    rootfs: Path
    size_bytes: int

    def passwd(self) -> dict[str, tuple[int, int, str]]:
        """The image's users: name -> (uid, gid, home)."""
        users = {}
        path = self.rootfs / "etc" / "passwd"
        for line in path.read_text().splitlines() if path.exists() else []:
            parts = line.split(":")
            if len(parts) >= 6 and parts[2].isdigit() and parts[3].isdigit():
                users[parts[0]] = (int(parts[2]), int(parts[3]), parts[5])
        return users


@dataclass
class ImageStore:
    """The built images' configs and root filesystems, for one session; `close()` unmounts them."""

    kind: str
    _open: dict[str, Image] = field(default_factory=dict)
    _containers: list[str] = field(default_factory=list)

    @classmethod
    def here(cls) -> ImageStore:
        kind = builder()
        if kind is None:
            raise RuntimeError("no image builder (Docker or buildah)")
        store = cls(kind)
        store.remove_leftovers()
        return store

    def image(self, ref: str) -> Image:
        if ref not in self._open:
            self._open[ref] = self._docker(ref) if self.kind == "docker" else self._buildah(ref)
        return self._open[ref]

    def _buildah(self, ref: str) -> Image:
        inspected = json.loads(_run(["buildah", "inspect", "--type", "image", ref]))
        manifest = json.loads(inspected["Manifest"])
        size = sum(int(layer["size"]) for layer in manifest["layers"])
        name = f"{CONTAINER_PREFIX}-{os.getpid()}-{len(self._containers)}"
        _run(["buildah", "from", "--pull-never", "--name", name, ref])
        self._containers.append(name)
        rootfs = Path(_run(["buildah", "mount", name]).strip())
        return Image(ref, ImageConfig.of(inspected["OCIv1"]["config"]), rootfs, size)

    def _docker(self, ref: str) -> Image:
        (inspected,) = json.loads(_run(["docker", "image", "inspect", ref]))
        rootfs = DOCKER_ROOTS / inspected["Id"].split(":")[-1][:24]
        if not (rootfs / ".complete").exists():
            shutil.rmtree(rootfs, ignore_errors=True)
            rootfs.mkdir(parents=True)
            container = _run(["docker", "create", ref]).strip()
            try:
                with subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE) as export, \
                        tarfile.open(fileobj=export.stdout, mode="r|") as archive:
                    archive.extractall(rootfs, filter="tar")
            finally:
                _run(["docker", "rm", container])
            (rootfs / ".complete").touch()
        return Image(ref, ImageConfig.of(inspected["Config"]), rootfs, int(inspected["Size"]))

    def close(self) -> None:
        for name in self._containers:
            subprocess.run(["buildah", "umount", name], capture_output=True, timeout=120)
            subprocess.run(["buildah", "rm", name], capture_output=True, timeout=120)
        self._containers.clear()
        self._open.clear()

    def remove_leftovers(self) -> None:
        """Working containers of earlier sessions whose process is gone."""
        if self.kind != "buildah":
            return
        listed = subprocess.run(["buildah", "containers", "--format", "{{.ContainerName}}"], capture_output=True,
                                text=True, timeout=120).stdout.split()
        for name in listed:
            match = re.fullmatch(rf"{CONTAINER_PREFIX}-(\d+)-\d+", name)
            if match and not Path(f"/proc/{match[1]}").exists():
                subprocess.run(["buildah", "umount", name], capture_output=True, timeout=120)
                subprocess.run(["buildah", "rm", name], capture_output=True, timeout=120)


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()[-1500:]}")
    return done.stdout
