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

The code is in layers, each a module that uses only those below it: the state (cluster_state.py), Services
and DNS (dns.py), the API server (api_server.py), port-forwards (port_forwards.py), pod templates from pod
specs (pod_templates.py), the kubelet (kubelet.py), and here the lifecycle, the controllers and the hosts
outside the cluster; the objects themselves (pods, templates, volumes, security) are in pods.py.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rehearsal.netns import (
    HomeThread,
    Host,
    grpc_threads_started,
    thread_namespaces,
    wait_until,
)
from rehearsal.network_policy import Peer
from rehearsal.rbac import serving_certificate

if TYPE_CHECKING:
    pass
from rehearsal.kubelet import Kubelet, die_with_parent
from rehearsal.pods import DOMAIN, NAMESPACE, REPO, VENV_BIN, Pod, Workload


class Cluster(Kubelet):
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
                                    start_new_session=True, preexec_fn=die_with_parent)

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


@contextlib.contextmanager
def running(cluster: Cluster) -> Iterator[Cluster]:
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
