"""The last steps of starting a process in a container, as an OCI runtime takes them after the mounts:
run by this machine's Python as root inside the pod's namespaces, it needs nothing from the image.

    enter_root.py new ROOT [PROCESS] -- ARGV   pivot_root into ROOT (the container's prepared root)
    enter_root.py join PID [PROCESS] -- ARGV   into the mount namespace of PID (kubectl exec, preStop)

PROCESS: --workdir DIR --uid N --gid N [--groups N,N] [--drop-all-capabilities] [--no-new-privileges].
Then the working directory, the supplementary groups, gid and uid, the capability bounding set and
inheritable and ambient capabilities (all, for a non-root user or --drop-all-capabilities), no new
privileges, and exec ARGV (found on the environment's PATH) with this process's environment, less
the harness's OWR_* variables.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

MNT_DETACH = 2
CLONE_NEWNS = 0x00020000
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _pivot_root_syscall() -> int:
    numbers = {"x86_64": 155, "aarch64": 41}
    machine = os.uname().machine
    if machine not in numbers:
        raise OSError(f"pivot_root: no syscall number known for {machine}")
    return numbers[machine]


def pivot_into(root: Path) -> None:
    """The container's root becomes this mount namespace's root; the old one is detached."""
    os.chdir(root)
    _check(libc.syscall(_pivot_root_syscall(), b".", b"."), f"pivot_root({root})")
    _check(libc.umount2(b".", MNT_DETACH), "umount2(old root)")
    os.chdir("/")


def join_mounts(pid: int) -> None:
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    try:
        _check(libc.setns(fd, CLONE_NEWNS), f"setns(mount namespace of {pid})")
    finally:
        os.close(fd)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges(uid: int, gid: int, groups: list[int], drop_all: bool, no_new_privileges: bool) -> None:
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    if drop_all or uid != 0:
        for cap in range(last_cap + 1):
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap} from the bounding set")
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)  # from root to another uid: the permitted and effective sets go with it
    if drop_all or uid != 0:
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        header, data = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
        _check(libc.capset(ctypes.byref(header), data), "capset(none)")
    if no_new_privileges:
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="enter_root.py")
    parser.add_argument("mode", choices=("new", "join"))
    parser.add_argument("target")
    parser.add_argument("--workdir", default="/")
    parser.add_argument("--uid", type=int, default=0)
    parser.add_argument("--gid", type=int, default=0)
    parser.add_argument("--groups", default="")
    parser.add_argument("--drop-all-capabilities", action="store_true")
    parser.add_argument("--no-new-privileges", action="store_true")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if args.mode == "new":
        pivot_into(Path(args.target))
    else:
        join_mounts(int(args.target))
    os.chdir(args.workdir)
    drop_privileges(args.uid, args.gid, [int(g) for g in args.groups.split(",") if g], args.drop_all_capabilities,
                    args.no_new_privileges)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWR_")}
    try:
        os.execvpe(command[0], command, env)
    except OSError as err:  # as a runtime reports it: the container's start fails
        print(f'exec: "{command[0]}": {err.strerror}', file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
