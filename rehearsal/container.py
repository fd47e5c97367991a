"""What a kubelet and its container runtime make of a container spec and the image it names.

- **The process** (:func:`process_of`): the container's `command` replaces the image's ENTRYPOINT
  (and drops its CMD), `args` replace CMD; the image's ENV first, the container's env over it; the
  container's `workingDir`, else the image's WORKDIR, else /; HOME from the image's /etc/passwd for
  the user the process runs as, unless the environment sets it.
- **The user** (:func:`rehearsal.pods.image_user`): the securityContext's runAsUser/runAsGroup win over the image's
  USER; a USER that is a name is looked up in the image's /etc/passwd, and cannot be verified by
  `runAsNonRoot` (the kubelet refuses such a container, as one that would run as root).
- **The root filesystem** (:func:`root_commands`): the image's root under a writable layer of the
  container's own (overlayfs; what the image holds is never written), /proc of the container's PID
  namespace, /sys read-only, a /dev of its own (null, zero, full, random, urandom, tty, a 64 MiB
  /dev/shm), the pod's /etc/hosts, /etc/resolv.conf and /etc/hostname, the volumes at their mount
  paths, and the root read-only where the securityContext says; then `enter_root.py` pivots into it,
  drops privileges and execs the process (:func:`enter_argv`).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rehearsal.pods import Security, Volume, home_of

if TYPE_CHECKING:
    from rehearsal.oci_images import Image

ENTER_ROOT = Path(__file__).with_name("enter_root.py")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_SHM_SIZE = "64m"  # the container runtimes' default /dev/shm


@dataclass(frozen=True)
class Process:
    argv: list[str]
    env: dict[str, str]  # the image's, the container's over it (HOME is settled with the user)
    workdir: str


def process_of(container: dict[str, Any], image: Image, container_env: dict[str, str]) -> Process:
    command, args = container.get("command"), container.get("args")
    if command:
        argv = [*command, *(args or [])]
    else:
        argv = [*image.config.entrypoint, *(args if args else image.config.cmd)]
    return Process(argv, {**image.config.env, **container_env}, container.get("workingDir") or image.config.workdir or "/")


def inside(rootfs: Path, path: str) -> str:
    """`path` resolved within the image's root filesystem as the container will see it: symlinks
    followed, an absolute link target taken from the container's root (Debian's /var/run -> /run), never
    leaving it. Returns the absolute path inside the container."""
    resolved: list[str] = []
    todo = [part for part in path.split("/") if part]
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        if part == ".":
            continue
        candidate = rootfs.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise ValueError(f"{path}: too many symlinks in {rootfs}")
            target = str(candidate.readlink())
            if target.startswith("/"):
                resolved = []
            todo = [p for p in target.split("/") if p] + todo
            continue
        resolved.append(part)
    return "/" + "/".join(resolved)


def root_commands(image: Image, root: Path, layer: Path, volumes: list[Volume], security: Security,
                  hostname_file: Path) -> list[str]:
    """Shell commands that make `root` the container's root filesystem, run inside the pod's mount
    namespace (after `ip netns exec`, whose /etc/hosts and /etc/resolv.conf are the pod's)."""
    q = shlex.quote
    upper, work = layer / "upper", layer / "work"
    commands = [f"mkdir -p {q(str(root))} {q(str(upper))} {q(str(work))}",
                f"mount -t overlay overlay -o lowerdir={image.rootfs},upperdir={upper},workdir={work} {q(str(root))}"]

    def at(path: str) -> str:
        # as runc's securejoin: a symlink in the image never points a mount outside the container's root;
        # /dev, /proc and /sys are the runtime's own mounts, not the image's
        if path.split("/")[1] not in ("dev", "proc", "sys"):
            path = inside(image.rootfs, path)
        return q(str(root / path.lstrip("/")))

    commands += [f"mkdir -p {at('/proc')} {at('/sys')} {at('/dev')} {at('/etc')}",
                 f"mount -t proc proc {at('/proc')}",
                 f"mount --rbind /sys {at('/sys')}", f"mount -o remount,bind,ro {at('/sys')}",
                 f"mount -t tmpfs -o mode=755,size=64k tmpfs {at('/dev')}"]
    for device in DEVICES:
        commands.append(f"touch {at('/dev/' + device)}; mount --bind /dev/{device} {at('/dev/' + device)}")
    commands += [f"ln -s /proc/self/fd {at('/dev/fd')}",
                 *(f"ln -s /proc/self/fd/{n} {at('/dev/' + name)}" for n, name in enumerate(("stdin", "stdout", "stderr"))),
                 f"mkdir -p {at('/dev/shm')}", f"mount -t tmpfs -o mode=1777,size={DEV_SHM_SIZE} shm {at('/dev/shm')}"]
    for name, source in (("hosts", "/etc/hosts"), ("resolv.conf", "/etc/resolv.conf"), ("hostname", str(hostname_file))):
        commands.append(f"touch {at('/etc/' + name)}; mount --bind {q(source)} {at('/etc/' + name)}")
    read_only = []
    # parents before what is mounted inside them (/etc/overworld, then /etc/overworld/tls)
    for volume in sorted(volumes, key=lambda v: len(Path(v.mount_path).parts)):
        target = at(volume.mount_path)
        group = security.fs_group
        if volume.kind == "memory":
            mode = "2777" if group is not None else "1777"
            commands.append(f"mkdir -p {target}; mount -t tmpfs -o size=1g,mode={mode}"
                            f"{f',gid={group}' if group is not None else ''} tmpfs {target}")
            continue
        if volume.source is None:
            raise ValueError(f"volume at {volume.mount_path} has no source directory")
        commands.append(f"mkdir -p {target}; mount --bind {q(str(volume.source))} {target}")
        if volume.read_only:
            read_only.append(f"mount -o remount,bind,ro {target}")
    commands += read_only
    if security.read_only_root:
        commands.append(f"mount -o remount,bind,ro {q(str(root))}")
    return commands


def enter_argv(mode: str, target: str, security: Security, workdir: str) -> list[str]:
    """`enter_root.py` (this machine's Python, root) with the process's user and privileges."""
    argv = [sys.executable, "-S", "-E", str(ENTER_ROOT), mode, target, "--workdir", workdir,
            "--uid", str(security.uid), "--gid", str(security.gid), "--groups", ",".join(map(str, security.groups))]
    if security.drop_all_capabilities:
        argv.append("--drop-all-capabilities")
    if security.no_new_privileges:
        argv.append("--no-new-privileges")
    return [*argv, "--"]


def run(image: Image, container: dict[str, Any], security: Security, volumes: list[Volume], scratch: Path,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """One container from `image` run to its end, as a pod without a network would run it (its own PID,
    mount, UTS and network namespaces); `scratch` holds its writable layer."""
    process = process_of(container, image, {})
    env = {"HOME": home_of(image, security.uid), **process.env}
    hostname = scratch / "hostname"
    scratch.mkdir(parents=True, exist_ok=True)
    hostname.write_text("image-test\n")
    commands = root_commands(image, scratch / "rootfs", scratch / "layer", volumes, security, hostname)
    enter = " ".join(shlex.quote(a) for a in enter_argv("new", str(scratch / "rootfs"), security, process.workdir))
    script = "set -e; hostname image-test; " + "; ".join(commands) + f'; exec {enter} "$@"'
    return subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts", "--net",
                           "--propagation", "private", "/bin/sh", "-c", script, "sh", *process.argv],
                          env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
