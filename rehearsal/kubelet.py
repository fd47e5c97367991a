"""The kubelet's part: pods started from their templates (namespaces, image root, volumes, security),
stopped with their grace period, restarted, probed, their namespaces' NetworkPolicies applied."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rehearsal.container import enter_argv, root_commands
from rehearsal.network_policy import NetworkPolicies, Peer
from rehearsal.pod_templates import PodTemplates
from rehearsal.pods import (
    DOMAIN,
    IMAGE_PATHS,
    NAMESPACE,
    POD_IP,
    REPO,
    SHM_SIZE,
    VENV_BIN,
    Pod,
    PodTemplate,
    Volume,
    Workload,
    closed_ancestor,
    random_suffix,
    run_as_non_root_refusal,
)

if TYPE_CHECKING:
    from rehearsal.oci_images import Image


class Kubelet(PodTemplates):
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
            for ancestor in sorted({a for p in IMAGE_PATHS if (a := closed_ancestor(p)) is not None}):
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
            own_for_group(source, group)
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
                                        preexec_fn=die_with_parent)
        pod.phase = "Running"
        pod.ready = False
        pod.started = time.monotonic()
        pod.probed.clear()
        pod.failed.clear()

    def delete_pod(self, pod: Pod, graceful: bool = False, wait: bool = True,
                   grace: float | None = None) -> threading.Thread:
        """`kubectl delete pod` (graceful: preStop, SIGTERM, grace period) or a node loss (SIGKILL).
        `grace`: `--grace-period`, as a spot node's reclaim cuts the pod's own short. Its disk goes with
        it; the workload's controller starts a new pod elsewhere."""
        with self.lock:
            if pod.deleting:
                thread = threading.Thread(target=lambda: None)
                thread.start()
                return thread
            pod.deleting = True
            pod.ready = False

        def run() -> None:
            if graceful:
                self._terminate(pod, grace)
            self._kill(pod)
            self.network.remove_host(pod.host)
            self.event("pod-gone", pod.name)

        thread = threading.Thread(target=run, name=f"delete-{pod.name}", daemon=True)
        thread.start()
        if wait:
            thread.join()
        return thread

    def _terminate(self, pod: Pod, grace: float | None = None) -> None:
        deadline = time.monotonic() + (pod.template.grace if grace is None else grace)
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

    def freeze(self, pod: Pod, frozen: bool) -> None:
        """SIGSTOP / SIGCONT every process of a pod."""
        for line in subprocess.run(["ip", "netns", "pids", pod.host.netns], capture_output=True, text=True,
                                   check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line), signal.SIGSTOP if frozen else signal.SIGCONT)

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


def own_for_group(root: Path, group: int) -> None:
    """A volume handed to a pod's fsGroup, as the kubelet does: group-owned, group-writable, new files
    inheriting the group (setgid directories)."""
    root.mkdir(parents=True, exist_ok=True)
    for path in [root, *root.rglob("*")]:
        with contextlib.suppress(OSError):
            os.lchown(path, -1, group)
            if not path.is_symlink():
                mode = path.stat().st_mode
                path.chmod(mode | 0o060 | (0o2010 if path.is_dir() else 0))


def die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
