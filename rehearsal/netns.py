"""Hosts made of Linux namespaces: each pod gets its own network namespace (one veth on a bridge that
lives in a switch namespace of its own, a 10.213.0.0/16 address that only exists on that bridge), its
own PID, mount and UTS namespaces (PID 1 is the container's command, `hostname` is the pod name),
its volumes bind-mounted at their mount paths, and its own /etc/hosts and /etc/resolv.conf
(`ip netns exec` reads /etc/netns/<ns>/).

Nothing is added to the machine's own network namespace. Every name starts with `owr<pid>-`, so
that :func:`remove_leftovers` can find and remove what a crashed earlier run left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

SUBNET = "10.213"
NAME_PREFIX = "owr"
NETNS_DIR = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")
CLONE_NEWNET = 0x40000000


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str) -> None:
    pids = ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def delete_netns(netns: str) -> None:
    _kill_namespace_processes(netns)
    ip("netns", "delete", netns, check=False)
    hosts_dir = ETC_NETNS / netns
    if hosts_dir.is_dir():
        for child in hosts_dir.iterdir():
            child.unlink()
        hosts_dir.rmdir()


def remove_leftovers() -> list[str]:
    """Delete the namespaces of earlier rehearsals whose pytest process is gone."""
    removed = []
    names = [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    names += [p.name for p in ETC_NETNS.glob(f"{NAME_PREFIX}*")] if ETC_NETNS.is_dir() else []
    for name in sorted(set(names)):
        match = re.match(rf"^{NAME_PREFIX}(\d+)-", name)
        if match and not _alive(int(match[1])):
            delete_netns(name)
            removed.append(name)
    for sockets in Path("/tmp").glob(f"{NAME_PREFIX}*-sockets"):  # the cluster's port-forward sockets
        match = re.match(rf"^{NAME_PREFIX}(\d+)-", sockets.name)
        if match and not _alive(int(match[1])):
            shutil.rmtree(sockets, ignore_errors=True)
            removed.append(str(sockets))
    return removed


def enter_netns(path: Path) -> None:
    """Move the calling thread (only it, and the threads it starts later) into a network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)


def thread_namespaces() -> dict[int, str]:
    """Every thread of this process (native id) and the network namespace it is in."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            out[int(task.name)] = os.readlink(task / "ns" / "net")
    return out


def grpc_threads_started() -> Any:
    """A channel that has made a call (to a closed port): gRPC's threads run, started from the calling
    thread, while it is open."""
    import grpc

    from overworld.core.grpc_util import serving

    channel = grpc.insecure_channel("127.0.0.1:9")
    serving(channel, timeout=0.5)
    return channel


T = TypeVar("T")


class HomeThread:
    """One thread in the network namespace of the thread that made it, running what other threads hand it.

    A thread inside a pod's or the control namespace must not start gRPC's threads: they inherit its
    namespace, and every TCP connection the process opens later through them (tests long after the
    rehearsal included) goes to that namespace's loopback: DEADLINE_EXCEEDED on 127.0.0.1. gRPC
    starts them from the thread of its first call, and starts them again from a thread that forks
    (its fork handlers stop them before a fork() and restart them after; a Popen with a preexec_fn
    forks, one without uses vfork and runs no handlers). So gRPC calls and forks go through here."""

    def __init__(self, name: str) -> None:
        self._work: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T], timeout: float) -> T:
        done: Future[T] = Future()
        self._work.put((fn, done))
        return done.result(timeout)

    def popen(self, argv: list[str], timeout: float = 30, **kwargs: Any) -> subprocess.Popen[bytes]:
        """subprocess.Popen, forked from this thread. A preexec_fn's PR_SET_PDEATHSIG follows this
        thread: the child is killed when it ends (close())."""
        return self.call(lambda: subprocess.Popen(argv, **kwargs), timeout)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            fn, done = item
            try:
                done.set_result(fn())
            except BaseException as err:  # handed to the caller
                done.set_exception(err)


_netem: list[bool] = []


def netem_available() -> bool:
    """Whether this kernel has netem (delay and loss on a link): tried once, on a veth in a namespace."""
    if not _netem:
        name = f"{NAME_PREFIX}{os.getpid()}-netem-probe"
        ip("netns", "add", name)
        try:
            ip("-n", name, "link", "add", "name", "a", "type", "veth", "peer", "name", "b")
            probe = subprocess.run(["tc", "-n", name, "qdisc", "add", "dev", "a", "root", "netem", "delay", "1ms"],
                                   capture_output=True, timeout=30)
            _netem.append(probe.returncode == 0)
        finally:
            delete_netns(name)
    return _netem[0]


@dataclass
class Host:
    """One network namespace with one address on the bridge."""

    netns: str
    veth: str
    address: str
    hosts_file: Path


@dataclass
class Network:
    """The bridge and the hosts on it."""

    prefix: str = field(default_factory=lambda: f"{NAME_PREFIX}{os.getpid()}")
    switch: str = ""
    _next: int = 2
    _lock: threading.Lock = field(default_factory=threading.Lock)
    hosts: dict[str, Host] = field(default_factory=dict)

    def create(self) -> None:
        self.switch = f"{self.prefix}-switch"
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, label: str) -> Host:
        with self._lock:
            index = self._next
            self._next += 1
        if index >= 250 * 250:
            raise RuntimeError("out of rehearsal addresses")
        netns = f"{self.prefix}-{label}-{index}"
        veth = f"v{index}"
        address = f"{SUBNET}.{index // 250}.{index % 250 + 2}"
        ip("netns", "add", netns)
        ip("-n", self.switch, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("-n", self.switch, "link", "set", veth, "master", "br0", "up")
        ip("-n", netns, "addr", "add", f"{address}/16", "dev", "eth0")
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "link", "set", "eth0", "up")
        # A default route as a pod has one (Ray finds its node address through it); it leads onto
        # the bridge only, where nothing answers for any address outside the rehearsal.
        ip("-n", netns, "route", "add", "default", "dev", "eth0")
        hosts_dir = ETC_NETNS / netns
        hosts_dir.mkdir(parents=True, exist_ok=True)
        (hosts_dir / "hosts").write_text(f"127.0.0.1 localhost\n{address} {label}\n")
        host = Host(netns, veth, address, hosts_dir / "hosts")
        self.hosts[netns] = host
        return host

    def remove_host(self, host: Host) -> None:
        delete_netns(host.netns)
        self.hosts.pop(host.netns, None)

    def shape(self, host: Host, rate_mbit: float, delay_ms: float = 0.0) -> None:
        """Make a host's link a NIC's: `rate_mbit` each way (on both ends of its veth: the host's egress,
        and the bridge's egress towards it, queueing up to 50 ms as a switch port's buffer would) and,
        where the kernel has netem, `delay_ms` on what the host sends (so `delay_ms` one way between
        two shaped hosts). A delay asked for on a kernel without netem is an error (netem_available())."""
        rate = rate_mbit * 1e6 / 8  # bytes/s
        burst = max(256 << 10, int(rate / 250))  # a veth's largest (GSO) packet fits the bucket
        bucket = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(max(2 * burst, int(rate / 20)))]
        egress = bucket
        if delay_ms:
            if not netem_available():
                raise RuntimeError("this kernel has no netem (sch_netem): links can be rate-shaped, not delayed")
            egress = ["netem", "rate", f"{rate_mbit}mbit", "delay", f"{delay_ms}ms", "limit", "100000"]
        for netns, dev, qdisc in ((host.netns, "eth0", egress), (self.switch, host.veth, bucket)):
            subprocess.run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *qdisc],
                           capture_output=True, text=True, check=True, timeout=30)

    def set_link(self, host: Host, up: bool) -> None:
        """Cut a host off the bridge (or reconnect it): its sockets stay open and hear nothing."""
        ip("-n", self.switch, "link", "set", host.veth, "up" if up else "down")

    def destroy(self) -> None:
        for host in list(self.hosts.values()):
            self.remove_host(host)
        if self.switch:
            delete_netns(self.switch)


def wait_until(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.5) -> T:
    """Poll `probe` until it returns something truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except Exception as err:  # a probe of something that is still starting
            last_error = err
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s (last error: {last_error})")
