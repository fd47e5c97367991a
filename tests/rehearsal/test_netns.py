"""The rehearsal's namespaced threads and gRPC: a gRPC call, or a fork, made for a thread inside a
namespace must leave no gRPC thread there. One that did sent every later TCP connection of the pytest
process into that namespace's loopback; the next test on 127.0.0.1 got DEADLINE_EXCEEDED (two CI
failures: the first from a probe, the second from a pod's start with a preexec_fn)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rehearsal.netns import NAME_PREFIX, delete_netns, ip

REPO = Path(__file__).resolve().parents[2]

# In a fresh interpreter, so that gRPC's thread pool does not exist yet: the namespaced thread's call
# is the one that starts it, as the rehearsal's controllers could.
SCRIPT = textwrap.dedent("""
    import sys, threading
    import grpc
    sys.path[:0] = [sys.argv[1], sys.argv[3]]  # the repository (the rehearsal package), services/
    from rehearsal import netns
    from overworld.core.grpc_util import health_status, serve

    home = netns.HomeThread("home")
    opened, release = threading.Event(), threading.Event()

    # Fork: gRPC's threads are up, here, before the namespaced thread forks; a channel keeps them up.
    before = netns.grpc_threads_started() if sys.argv[4] == "fork" else None

    def controllers():
        netns.enter_netns(f"/var/run/netns/{sys.argv[2]}")
        if before is not None:  # a pod's start, as the rehearsal's controllers make it
            home.popen(["true"], start_new_session=True, preexec_fn=lambda: None).wait(timeout=10)
            channel = None
        else:
            channel = home.call(netns.grpc_threads_started, timeout=10)  # a probe of something not up yet
        opened.set()
        release.wait()
        if channel is not None:
            channel.close()

    thread = threading.Thread(target=controllers)
    thread.start()
    opened.wait()
    kept = grpc.insecure_channel("127.0.0.1:9")  # the rest of the process keeps gRPC's pool alive
    release.set()
    thread.join()
    own = netns.thread_namespaces()[threading.get_native_id()]
    server = serve([], "127.0.0.1", 0)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        status = health_status(channel, timeout=5, wait_for_ready=True)
    elsewhere = [tid for tid, ns in netns.thread_namespaces().items() if ns != own]
    print(f"status={status} threads-elsewhere={len(elsewhere)}")
    kept.close()
    server.stop(0)
    home.close()
""")


@pytest.mark.parametrize("made", ["call", "fork"])
def test_a_grpc_call_or_a_fork_for_a_namespaced_thread_leaves_no_grpc_thread_in_its_namespace(
        made: str, tmp_path: Path) -> None:
    name = f"{NAME_PREFIX}{os.getpid()}-homethread"
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        script = tmp_path / "probe.py"
        script.write_text(SCRIPT)
        out = subprocess.run([sys.executable, str(script), str(REPO), name,
                              str(REPO / "services"), made], capture_output=True, text=True, timeout=60)
    finally:
        delete_netns(name)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "status=1 threads-elsewhere=0" in out.stdout, out.stdout + out.stderr[-3000:]
