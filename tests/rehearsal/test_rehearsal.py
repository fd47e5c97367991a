"""The cluster rehearsal: the rendered chart (CPU values, a CartPole run) as pods on their own hosts
with their own disks, the trainer as the RayJob the run-controller makes, and what a cluster does to
them: pods deleted, fleets scaled, links cut, a run resumed with kubectl.

One cluster serves every test of this module (bringing it up is most of the cost); the tests run in
file order and each leaves the cluster training. A real Prometheus watches it all along as the chart's
monitors tell a cluster's Prometheus to (rehearsal/prometheus.py): its targets, its alerts and
every dashboard query are tested here too. `make rehearsal` runs just these.

Every Ray cluster (re)start costs minutes on two busy cores, so there are three: the first, the one
after the Ray head and a Ray worker are deleted together, and the resumed run's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from overworld.run_controller.rayjob import stop_seconds
from rehearsal.netns import wait_until
from rehearsal.oci_images import OBJECT_STORE, REDIS, ImageStore, reference
from rehearsal.pods import NAMESPACE, RELEASE, REPO
from rehearsal.prometheus import MONITORING
from rehearsal.training_rehearsal import Rehearsal, worker_stops

# Ray clusters come and go in some of these: minutes each on two busy cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKERS = f"{RELEASE}-rollout-worker"
BUFFER = f"{RELEASE}-replay-buffer"


@pytest.fixture(scope="module")
def rehearsal(image_store: ImageStore) -> Iterator[Rehearsal]:
    with Rehearsal.up(Path("/var/tmp") / f"overworld-rehearsal-{os.getpid()}", image_store) as started:
        started.wait_training(timeout=360)
        yield started


def progress(rehearsal: Rehearsal) -> tuple[int, int]:
    """(model version, env steps) as the trainer reports them."""
    status = rehearsal.trainer_status()
    return int(status.model_version), int(status.env_steps)


def wait_progress_beyond(rehearsal: Rehearsal, version: int, env_steps: int, timeout: float, what: str) -> None:
    """Training goes on: the registry gets newer versions and the trainer counts on from where it was."""
    newer = rehearsal.wait_training(beyond=version + 1, timeout=timeout)

    def counted_on() -> bool:
        now_version, now_steps = progress(rehearsal)
        return now_version > version and now_steps > env_steps

    try:
        wait_until(counted_on, timeout, f"{what}: trainer past version {version} and {env_steps} env steps")
    except TimeoutError as err:
        raise AssertionError(f"{err} (registry at {newer})\n{rehearsal.cluster.logs(tail=2000)}") from err


def counter(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


# --- someone else's pod on the pod network -----------------------------------------------------


SERVICE_PORTS = {"rollout-manager": 50051, "replay-buffer": 50052, "gae": 50053, "model-registry": 50054,
                 "rollout-worker": 50056}
METRICS_PORT, HEALTH_PORT = 9090, 8081
WEIGHTS_PORTS = {"model-registry": 50064, "rollout-worker": 50066}
PUBLISH_PORT = 50065  # the registry's, for the trainer's pods only


def test_only_the_runs_own_pods_get_in(rehearsal: Rehearsal, tmp_path: Path) -> None:
    """Someone else's pod (its own namespace on the bridge, no labels of the release): the
    NetworkPolicies drop its packets to every service, Redis and the object store. A pod that carries
    the release's worker labels (a compromised worker) gets through the network to the services, but
    is refused by every service pod and the trainer in plaintext or with a certificate of another CA,
    gets PERMISSION_DENIED, naming it and the method, on every method a stolen rollout-worker or gae
    certificate may not call, 401/403 from Ray's Jobs API without the cluster's token; Redis and the
    object store drop it. A pod with the replay-buffer's labels reaches Redis, which asks for its
    password, and is dropped at the weights stream (the registry's and a worker's relay).

    Namespaces and ports, probed: a pod of another namespace carrying the release's own labels is
    dropped on every port (a podSelector alone selects pods of the policy's namespace); the metrics
    port of the services admits the `monitoring` namespace (the values' metricsNamespaceSelector) and
    nothing else: the compromised worker and a pod of a third namespace are dropped there (the Ray
    head's ports, its metrics too, are open to the release's pods), and a monitoring pod reaches
    /metrics of every service pod and the trainer but is dropped on their gRPC and health ports."""
    from overworld.core.security import tls

    cluster = rehearsal.cluster
    head = cluster.pod(f"{rehearsal.rayjob()['status']['rayClusterName']}-head")
    targets = {p.name: [kind, f"{p.ip}:{port}"] for kind, port in SERVICE_PORTS.items()
               for p in cluster.pods_of(f"{RELEASE}-{kind}")}
    targets[head.name] = ["trainer", f"{head.ip}:50055"]
    stores = {"redis": f"{cluster.pod(f'{RELEASE}-redis').ip}:6379",
              "object-store": f"{cluster.pod(f'{RELEASE}-seaweedfs').ip}:8333"}
    intruder = [sys.executable, str(REPO / "rehearsal" / "intruder.py")]

    def run(name: str, spec: dict[str, object], labels: dict[str, str] | None,
            namespace: str = NAMESPACE) -> dict[str, object]:
        (tmp_path / f"{name}.json").write_text(json.dumps(spec))
        found: dict[str, object] = json.loads(cluster.run_outside(name, [*intruder, str(tmp_path / f"{name}.json")],
                                                                  labels=labels, namespace=namespace, timeout=300))
        return found

    def on_port(port: int) -> dict[str, str]:
        return {f"{name} :{port}": f"{address.rpartition(':')[0]}:{port}" for name, (_, address) in targets.items()}

    outsider = run("outsider", {"reach": {**{k: a for k, (_, a) in targets.items()}, **stores}}, labels=None)
    assert set(outsider["reach"].values()) == {"dropped"}, outsider  # type: ignore[union-attr]

    worker_labels = cluster.pod(f"{RELEASE}-rollout-worker").template.labels
    # every Ray port, the trainer's metrics too, is open to the release's pods (the Ray token guards them)
    services_metrics = {k: v for k, v in on_port(METRICS_PORT).items() if not k.startswith(head.name)}
    spec = {"targets": targets, "reach": {**stores, **services_metrics},
            "other_ca": str(tls.write_run_credentials(tmp_path / "other", RELEASE)["trainer"]),
            "stolen": {i: str(rehearsal.identity(i)) for i in ("rollout-worker", "gae")},
            "ray_dashboard": f"{head.ip}:8265"}
    weights = {"registry weights": f"{cluster.pod(f'{RELEASE}-model-registry').ip}:{WEIGHTS_PORTS['model-registry']}",
               "relay": f"{cluster.pod(f'{RELEASE}-rollout-worker').ip}:{WEIGHTS_PORTS['rollout-worker']}"}
    publish = {"registry publish": f"{cluster.pod(f'{RELEASE}-model-registry').ip}:{PUBLISH_PORT}"}
    spec["reach"] = {**spec["reach"], **weights, **publish}  # type: ignore[dict-item]
    found = run("compromised-worker", spec, labels=worker_labels)
    reached: dict[str, str] = found["reach"]  # type: ignore[assignment]
    assert reached["registry publish"] == "dropped", found["reach"]  # only the trainer publishes
    assert reached.pop("registry weights") == "open", found["reach"]  # a worker's way to the weights
    assert reached.pop("relay") in ("open", "refused"), found["reach"]  # through (relaying, or not yet)
    assert set(reached.values()) == {"dropped"}, reached
    plaintext, other_ca, denied = found["plaintext"], found["other_ca"], found["denied"]
    assert isinstance(plaintext, dict) and isinstance(other_ca, dict) and isinstance(denied, dict)
    assert set(plaintext) == set(targets) and len(targets) >= 7
    assert set(plaintext.values()) == {"UNAVAILABLE"}, plaintext
    assert set(other_ca.values()) == {"UNAVAILABLE"}, other_ca
    for identity, answers in denied.items():
        assert answers, identity
        for call, (code, details) in answers.items():
            assert code == "PERMISSION_DENIED" and identity in details and call.split()[1] in details, (call, code, details)
    # a worker's certificate may not publish weights, tag versions or sample: every service was tried
    worker_calls = {call.split()[1] for call in denied["rollout-worker"]}
    assert {"/overworld.v1.ModelRegistry/Publish", "/overworld.v1.ModelRegistry/SetTag",
            "/overworld.v1.ReplayBuffer/Sample", "/overworld.v1.Trainer/ReportProgress"} <= worker_calls
    assert found["ray_jobs_api"] == {"no token": 401, "wrong token": 403}

    # the allowed path: the replay-buffer's labels get through to Redis, which wants its password
    # ... and is dropped at the weights stream, which only rollout workers may reach
    buffer_like = run("buffer-like", {"redis": stores["redis"], "reach": {**weights, **publish}},
                      labels=cluster.pod(f"{RELEASE}-replay-buffer").template.labels)
    assert buffer_like["redis"] == "-NOAUTH", buffer_like
    assert buffer_like["reach"] == {name: "dropped" for name in {**weights, **publish}}, buffer_like

    grpc_ports = {name: address for name, (_, address) in targets.items()}
    elsewhere = run("elsewhere", {"reach": {**grpc_ports, **on_port(METRICS_PORT), **stores}}, labels=worker_labels,
                    namespace="elsewhere")
    assert set(elsewhere["reach"].values()) == {"dropped"}, elsewhere  # type: ignore[union-attr]
    monitoring = run("monitoring", {"reach": {**grpc_ports, **on_port(METRICS_PORT), **on_port(HEALTH_PORT)}},
                     labels={"app.kubernetes.io/name": "prometheus"}, namespace=MONITORING)
    reach: dict[str, str] = monitoring["reach"]  # type: ignore[assignment]
    assert {reach[k] for k in on_port(METRICS_PORT)} == {"open"}, reach
    assert {reach[k] for k in [*grpc_ports, *on_port(HEALTH_PORT)]} == {"dropped"}, reach


def test_pods_run_as_their_security_context_says(rehearsal: Rehearsal) -> None:
    """The services run as the chart's user (10001) with its fsGroup, no capabilities and a read-only
    root filesystem: they can read their certificates (0440, the fsGroup's) and write only their
    volumes. Redis runs as its own user (999) and owns its data volume."""
    cluster = rehearsal.cluster
    probe = ("import os, pathlib\n"
             "status = dict(l.split(':\\t', 1) for l in open('/proc/1/status').read().splitlines() if ':\\t' in l)\n"
             "def writable(path):\n"
             "    try:\n"
             "        pathlib.Path(path, '.probe').write_text('x'); os.remove(os.path.join(path, '.probe')); return True\n"
             "    except OSError:\n"
             "        return False\n"
             "print(os.getuid(), os.getgid(), ','.join(map(str, sorted(os.getgroups()))), status['CapEff'].strip(), status['NoNewPrivs'].strip(),"
             " writable('/tmp'), writable('/etc'), writable(os.path.dirname(os.__file__)),"
             " len(open('/etc/overworld/tls/tls.key').read()) > 0)")
    for owner in (f"{RELEASE}-model-registry", f"{RELEASE}-rollout-worker"):
        uid, gid, groups, caps, no_new, tmp, etc, image, key = rehearsal.exec(cluster.pod(owner), "python", "-c",
                                                                              probe).split()
        assert (uid, gid) == ("10001", "10001") and "10001" in groups.split(","), (owner, uid, gid, groups)
        assert caps == "0000000000000000" and no_new == "1", (owner, caps, no_new)
        assert (tmp, etc, image, key) == ("True", "False", "False", "True"), owner
    redis = cluster.pod(f"{RELEASE}-redis")
    assert rehearsal.exec(redis, "sh", "-c", "id -u; stat -c %g /data").split() == ["999", "999"]


def test_every_pod_runs_from_the_image_its_manifest_names(rehearsal: Rehearsal) -> None:
    """Each pod's root filesystem is the image its manifest names (the RayJob's head, worker and
    submitter: the TrainingRun's trainer image; Redis and SeaweedFS: their stand-ins), under a layer of
    its own; the checkout is not in it; its PID 1 is the image's entrypoint with the chart's args (the
    Ray nodes: KubeRay's command), its environment the image's ENV with the container's env over it."""
    cluster = rehearsal.cluster
    ray_cluster = rehearsal.rayjob()["status"]["rayClusterName"]
    expected = {f"{RELEASE}-redis": REDIS, f"{RELEASE}-seaweedfs": OBJECT_STORE,
                f"{RELEASE}-rollout-worker": reference("rollout-worker"), f"{ray_cluster}-head": reference("trainer"),
                f"{ray_cluster}-worker-gpu": reference("trainer"),
                **{f"{RELEASE}-{name}": reference("services") for name in
                   ("rollout-manager", "model-registry", "gae", "replay-buffer", "run-controller")}}
    running = [p for p in cluster.pods if p.phase == "Running" and not p.deleting]
    assert {p.owner for p in running} >= set(expected), sorted({p.owner for p in running})
    for pod in running:
        image = pod.template.image
        assert image is not None, f"{pod.name} runs from this machine's root filesystem"
        assert image.reference == expected.get(pod.owner, image.reference), (pod.name, image.reference)
        pid1 = pod.pid1()
        assert pid1 is not None, pod.name
        root = next(line.split(" - ")[1].split() for line in Path(f"/proc/{pid1}/mountinfo").read_text().splitlines()
                    if line.split()[4] == "/")
        assert root[0] == "overlay" and f"lowerdir={image.rootfs}" in root[2], (pod.name, root)
        assert not Path(f"/proc/{pid1}/root{REPO}").exists(), f"{pod.name} sees the checkout"
    worker = cluster.pod(WORKERS)
    pid1 = worker.pid1()
    argv = Path(f"/proc/{pid1}/cmdline").read_bytes().decode().split("\0")
    assert argv[1:4] == ["/opt/overworld/bin/overworld", "serve", "rollout-worker"], argv
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid1}/environ").read_bytes().decode().split("\0") if item)
    image_env = worker.template.image.config.env  # type: ignore[union-attr]
    assert environ["NUMBA_CACHE_LOCATOR_CLASSES"] == image_env["NUMBA_CACHE_LOCATOR_CLASSES"]
    assert environ["PATH"] == image_env["PATH"] and "OVERWORLD_ROLLOUT_MANAGER" in environ, sorted(environ)
    assert os.readlink(f"/proc/{pid1}/cwd") == "/tmp"


# --- watched as a cluster's Prometheus watches it --------------------------------------------------


def scraped(rehearsal: Rehearsal) -> dict[str, list[dict[str, Any]]]:
    """Pod name -> its active targets in Prometheus (the chart's jobs only)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for target in rehearsal.prometheus.targets():
        if target["labels"].get("overworld_release") == RELEASE:
            out.setdefault(target["labels"]["pod"], []).append(target)
    return out


def test_prometheus_scrapes_every_pod_the_charts_monitors_select(rehearsal: Rehearsal) -> None:
    """Prometheus, configured from the rendered ServiceMonitor and PodMonitor as the prometheus-operator
    configures it and scraping from the `monitoring` namespace through the chart's NetworkPolicies,
    scrapes every pod of every Overworld service, the rollout worker, the run-controller and the
    trainer's Ray head, each once (not again through the headless Services), healthy, labelled with
    the release, namespace, pod and component the dashboards select on; nothing else of the release
    (Redis, the object store, the Ray worker, which serves no metrics)."""
    cluster = rehearsal.cluster
    head = cluster.pod(f"{rehearsal.rayjob()['status']['rayClusterName']}-head")
    owners = [f"{RELEASE}-{name}" for name in ("rollout-manager", "replay-buffer", "gae", "model-registry",
                                               "rollout-worker", "run-controller")]
    expected = {p.name: p.template.labels["app.kubernetes.io/component"]
                for p in [*(p for o in owners for p in cluster.pods_of(o)), head]}

    def all_up() -> bool:
        found = scraped(rehearsal)
        return found.keys() >= expected.keys() and all(t["health"] == "up" for p in expected for t in found[p])

    try:
        wait_until(all_up, 60, "every expected pod scraped and up")
    except TimeoutError as err:
        raise AssertionError(f"{err}: {json.dumps(scraped(rehearsal), indent=1)[:6000]}") from err
    found = scraped(rehearsal)
    assert found.keys() == expected.keys(), sorted(found.keys() ^ expected.keys())
    for pod, targets in found.items():
        (target,) = targets
        labels = target["labels"]
        assert (labels["namespace"], labels["component"]) == (NAMESPACE, expected[pod]), labels
    # what a dashboard variable reads: the release and namespace come from the scrape, not the pods
    assert rehearsal.prometheus.query(f'overworld_rollout_workers{{namespace="{NAMESPACE}", '
                                      f'overworld_release="{RELEASE}"}}'), "the rollout-manager's gauge"


def test_the_run_controller_gets_only_what_its_role_grants(rehearsal: Rehearsal) -> None:
    """The run-controller reached the API server as its ServiceAccount, through RBAC with the chart's
    Role: every call it made is one the Role grants, it made the calls a TrainingRun needs, and with its
    token anything else is refused as the API server refuses it (403 Forbidden, naming the user, the verb
    and the resource): Secrets, deleting its TrainingRun, a RayJob of another namespace."""
    cluster = rehearsal.cluster
    account = next(o for o in rehearsal.objects if o["kind"] == "ServiceAccount"
                   and o["metadata"]["name"] == f"{RELEASE}-run-controller")["metadata"]["name"]
    user = f"system:serviceaccount:{NAMESPACE}:{account}"
    made = [r for r in cluster.api_requests if r.user == user]
    assert {("create", "ray.io", "rayjobs"), ("patch", "overworld.dev", "trainingruns/status")} <= {
        (r.verb, r.group, r.resource) for r in made}, sorted({(r.verb, r.resource) for r in made})
    assert all(cluster.authorizer.allowed(r) for r in made), [r for r in made if not cluster.authorizer.allowed(r)]
    for args, verb, resource, where in (
            (("get", "--raw", f"/api/v1/namespaces/{NAMESPACE}/secrets"), "list", "secrets",
             f'in the namespace "{NAMESPACE}"'),
            (("delete", "trainingrun", RELEASE), "delete", "trainingruns", f'in the namespace "{NAMESPACE}"'),
            (("get", "rayjobs", "-n", "elsewhere"), "list", "rayjobs", 'in the namespace "elsewhere"')):
        refused = cluster.kubectl_as(user, *args)
        assert refused.returncode != 0, (args, refused.stdout)
        assert "(Forbidden)" in refused.stderr and f'User "{user}" cannot {verb} resource "{resource}"' in refused.stderr \
            and where in refused.stderr, (args, refused.stderr)
    assert rehearsal.training_run()["metadata"]["name"] == RELEASE  # not deleted


# --- two replay-buffer replicas behind one name ---------------------------------------------------


def test_replay_buffer_replicas_both_serve_and_cover_for_each_other(rehearsal: Rehearsal) -> None:
    """Clients balance over the headless Service's pods (round robin): the trainer's sample calls
    reach both replicas; when one dies, its clients (the worker's insert stream too) move to the
    other and training goes on."""
    cluster = rehearsal.cluster
    fronts = cluster.pods_of(BUFFER)
    assert len(fronts) == 2

    def served(pod: object, name: str) -> float:
        return counter(rehearsal.metrics(pod), name)  # type: ignore[arg-type]

    before = {p.name: served(p, "overworld_replay_buffer_samples_total") for p in fronts}
    wait_until(lambda: all(served(p, "overworld_replay_buffer_samples_total") > before[p.name] for p in fronts),
               120, "sample calls on both replay-buffer replicas")

    # The replica holding the worker's insert stream dies, and no replacement comes meanwhile.
    inserts = {p.name: served(p, "overworld_replay_buffer_inserts_total") for p in fronts}
    victim = max(fronts, key=lambda p: inserts[p.name])
    survivor = next(p for p in fronts if p is not victim)
    cluster.workloads[BUFFER].replicas = 1
    version, steps = progress(rehearsal)
    survivor_inserts = served(survivor, "overworld_replay_buffer_inserts_total")
    cluster.delete_pod(victim)
    wait_until(lambda: served(survivor, "overworld_replay_buffer_inserts_total") > survivor_inserts + 8, 120,
               "the worker's fragments going to the surviving replica")
    wait_progress_beyond(rehearsal, version, steps, 180, "one replay-buffer replica left")
    cluster.workloads[BUFFER].replicas = 2
    wait_until(lambda: len(cluster.pods_of(BUFFER)) == 2 and all(p.ready for p in cluster.pods_of(BUFFER)), 120,
               "the second replica back")


# --- probes and resources ----------------------------------------------------------------------------


def test_a_pod_that_stops_answering_goes_unready_then_is_restarted(rehearsal: Rehearsal) -> None:
    """The gae pod frozen (SIGSTOP): its readiness probe fails 3 times (5 s apart) and the Service stops
    naming it; its liveness probe fails 6 times (10 s apart) and the kubelet restarts the container,
    which answers again; training goes on."""
    cluster = rehearsal.cluster
    (gae,) = cluster.pods_of(f"{RELEASE}-gae")
    restarts, version, env_steps = gae.restarts, *progress(rehearsal)
    cluster.freeze(gae, True)
    try:
        wait_until(lambda: not gae.ready and gae.ip not in cluster.addresses(f"{RELEASE}-gae"), 40,
                   "the frozen gae pod unready and out of its Service")
        wait_until(lambda: gae.restarts > restarts, 120, "the kubelet restarting gae after its liveness probe failed")
    finally:
        cluster.freeze(gae, False)
    wait_until(lambda: gae.ready and cluster.addresses(f"{RELEASE}-gae") == [gae.ip], 120, "gae ready again")
    kinds = [(kind, what) for _, kind, what in cluster.events if gae.name in what]
    assert any(kind == "Unhealthy" for kind, _ in kinds) and any(kind == "Killing" for kind, _ in kinds), kinds
    wait_progress_beyond(rehearsal, version, env_steps, 300, "after gae's restart")


def test_a_pod_asking_for_a_gpu_the_node_lacks_stays_pending(rehearsal: Rehearsal) -> None:
    """The node declares one GPU, which the Ray worker group's pod holds: the rollout-worker Deployment
    rendered with `rolloutWorker.gpu.enabled` (a limit of one nvidia.com/gpu) gets no pod, and the
    scheduler's event says why, as `kubectl describe` would show it."""
    from rehearsal.training_rehearsal import rehearsal_values
    from tests.deploy.deploy_support import by_kind, render

    cluster = rehearsal.cluster
    values = rehearsal_values()
    values["rolloutWorker"]["gpu"] = {"enabled": True}
    manifest = by_kind(render(values, release=RELEASE, namespace="rl"), "Deployment")[WORKERS]
    workload = cluster.workload_from_manifest(manifest)
    assert workload.template.extended == {"nvidia.com/gpu": 1}
    workload.name = f"{WORKERS}-gpu"
    cluster.add_workload(workload)
    try:
        wait_until(lambda: any(kind == "FailedScheduling" and workload.name in what for _, kind, what in cluster.events),
                   30, "the scheduler's event")
        assert not cluster.pods_of(workload.name, include_ended=True)
        (event,) = [what for _, kind, what in cluster.events if kind == "FailedScheduling" and workload.name in what]
        assert "0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in event, event
    finally:
        cluster.remove_workload(workload.name)


# --- alerts fire for real ----------------------------------------------------------------------------


def test_alerts_fire_when_the_fleet_is_gone_and_resolve_when_it_is_back(rehearsal: Rehearsal) -> None:
    """The rollout workers scaled to 0: the rollout-manager's live leases drop to 0 and
    OverworldWorkersDown fires; the learner, starved of fragments, makes no update for
    learnerStallSeconds and OverworldLearnerStalled fires (both with the values' 10 s `for:`, evaluated by
    Prometheus from the rendered PrometheusRule). One worker back: both resolve."""
    prometheus = rehearsal.prometheus
    alerts = {"OverworldWorkersDown", "OverworldLearnerStalled"}
    wait_until(lambda: not alerts & prometheus.firing(), 180, "no alert firing before the fault")
    rehearsal.cluster.scale(WORKERS, 0)
    try:
        wait_until(lambda: alerts <= prometheus.firing(), 300, f"{sorted(alerts)} firing")
        firing = {a["labels"]["alertname"]: a for a in prometheus.alerts() if a["state"] == "firing"}
        for name in alerts:
            assert firing[name]["labels"]["severity"] == "critical", firing[name]
            assert f"Overworld {RELEASE} " in firing[name]["annotations"]["summary"], firing[name]
    finally:
        rehearsal.cluster.scale(WORKERS, 1)
    wait_until(lambda: not alerts & prometheus.firing(), 300, f"{sorted(alerts)} resolved")
    assert prometheus.value(f'max(overworld_rollout_workers{{overworld_release="{RELEASE}"}})') == 1


# --- a worker cut off for 30 s --------------------------------------------------------------------


def live_workers(rehearsal: Rehearsal) -> dict[str, int]:
    """Workers with a live lease at the rollout-manager -> their env steps."""
    return {w.worker_id: int(w.env_steps) for w in rehearsal.fleet().workers if w.seconds_since_heartbeat < 10}


def settled_inserts(rehearsal: Rehearsal) -> Callable[[], int]:
    """A probe: the index's insert count once it read the same three times, a second apart (0 until
    then; a front working through a backlog on two busy cores may go a second between two inserts)."""
    last: list[int] = []

    def probe() -> int:
        last.append(int(rehearsal.redis_meta().get("inserted", 0)))
        return last[-1] if len(last) > 2 and last[-1] == last[-2] == last[-3] else 0

    return probe


def test_worker_cut_off_rejoins_without_losing_or_duplicating_fragments(rehearsal: Rehearsal) -> None:
    """One worker alone feeds the buffer; its link is down for 30 s, then up again. It rejoins (a
    new lease) and keeps sending; stopped at the end, the fragments it counts as acknowledged are
    exactly those the index gained: none lost, none stored twice."""
    cluster = rehearsal.cluster
    cluster.scale(WORKERS, 0)
    # Gone means stopped: a terminating worker still flushes its last fragments into the index.
    wait_until(lambda: all(p.ended for p in cluster.pods_of(WORKERS, include_ended=True)), 120,
               "no rollout worker running")
    inserted_before = wait_until(settled_inserts(rehearsal), 30, "the index settled", interval=1.0)
    cluster.scale(WORKERS, 1)
    wait_until(lambda: len(live_workers(rehearsal)) == 1
               and int(rehearsal.redis_meta().get("inserted", 0)) > inserted_before + 8, 180, "the worker sending")
    (worker,) = cluster.pods_of(WORKERS)
    cluster.network.set_link(worker.host, up=False)
    cut = time.monotonic()
    try:
        # What the fronts took before the cut still reaches the index (two busy cores: seconds);
        # then nothing does until the link is back.
        cut_at = wait_until(settled_inserts(rehearsal), 20, "the index settling after the cut", interval=1.0)
        time.sleep(max(0.0, cut + 30 - time.monotonic()))
        assert int(rehearsal.redis_meta().get("inserted", 0)) == cut_at, "fragments arrived over a cut link"
    finally:
        cluster.network.set_link(worker.host, up=True)
    rejoined_at = int(rehearsal.redis_meta().get("inserted", 0))
    wait_until(lambda: int(rehearsal.redis_meta().get("inserted", 0)) > rejoined_at + 16, 180,
               "fragments from the worker after the link came back")
    wait_until(lambda: len(live_workers(rehearsal)) == 1, 60, "the worker's lease live again")
    cluster.delete_pod(worker, graceful=True)  # it flushes and logs what was acknowledged
    flushed = re.findall(r"sender flushed: .*\((\d+) complete fragments, (\d+) acknowledged, (\d+) rejected",
                         worker.log.read_text(errors="replace"))
    assert flushed, worker.log.read_text(errors="replace")[-3000:]
    complete, acknowledged, rejected = map(int, flushed[-1])
    gained = int(rehearsal.redis_meta().get("inserted", 0)) - inserted_before
    assert rejected == 0
    assert acknowledged == complete, f"{complete - acknowledged} complete fragments never acknowledged"
    assert gained == acknowledged, f"the index gained {gained} fragments, the worker had {acknowledged} acknowledged"
    # Its replacement (one replica) is the fleet of one the next test scales.


# --- rollout workers scaled while training ----------------------------------------------------------


def test_rollout_workers_scale_one_four_two_while_training(rehearsal: Rehearsal) -> None:
    """The fleet follows `kubectl scale` (1 -> 4 -> 2), and every worker of it produces: the
    throughput is the fleet's, not one worker's. A scale-down is a preemption: each worker removed
    hands in what it held (every complete fragment acknowledged by the replay buffer) before it goes.
    Back to one worker afterwards (two cores)."""
    cluster = rehearsal.cluster
    assert cluster.workloads[WORKERS].replicas == 1
    for size in (4, 2):
        running = {p.name for p in cluster.pods_of(WORKERS)}
        cluster.scale(WORKERS, size)
        wait_until(lambda n=size: len(cluster.pods_of(WORKERS)) == n and len(live_workers(rehearsal)) == n, 180,
                   f"{size} live rollout workers")
        first = live_workers(rehearsal)
        start = rehearsal.fleet().env_steps
        wait_until(lambda f=first: (now := live_workers(rehearsal)).keys() == f.keys()
                   and all(now[w] > f[w] for w in f), 120, f"new env steps from each of {size} workers")
        assert rehearsal.fleet().env_steps > start
        leaving = [p for p in cluster.pods_of(WORKERS, include_ended=True) if p.name in running and p.deleting]
        assert len(leaving) == max(0, len(running) - size)
        wait_until(lambda g=leaving: all(p.ended for p in g), 60, "the removed workers gone")
        for pod in leaving:
            (stop,) = worker_stops(pod)
            assert stop["flushed"] and stop["acknowledged"] == stop["complete"] and not stop["rejected"], (pod.name, stop)
    version, steps = progress(rehearsal)
    wait_progress_beyond(rehearsal, version, steps, 180, "after scaling")
    cluster.scale(WORKERS, 1)


# --- every pod deleted once -----------------------------------------------------------------------


def delete_and_recover(rehearsal: Rehearsal, owners: list[str], timeout: float) -> None:
    cluster = rehearsal.cluster
    version, steps = progress(rehearsal)
    inserted = int(rehearsal.redis_meta().get("inserted", 0))
    victims = [cluster.pods_of(owner)[0] for owner in owners]
    old_addresses = {p.ip for p in victims}
    threads = [cluster.delete_pod(p, wait=False) for p in victims]
    for thread in threads:
        thread.join()
    for owner in owners:
        wait_until(lambda o=owner: cluster.pods_of(o) and all(p.ready for p in cluster.pods_of(o)), timeout,
                   f"{owner} back")
        assert not {p.ip for p in cluster.pods_of(owner)} & old_addresses, f"{owner} came back on its old address"
    wait_progress_beyond(rehearsal, version, steps, timeout, f"after deleting {owners}")
    # The index lives on the Redis volume: nothing it acknowledged is forgotten.
    assert int(rehearsal.redis_meta().get("inserted", 0)) >= inserted


def test_deleting_every_service_pod_and_the_stores_once(rehearsal: Rehearsal) -> None:
    """One pod of each service, Redis and the S3 server deleted at once. Redis and the S3 server come
    back on their volumes; the index and the blobs it points at are still there (every live blob key
    of the index is readable)."""
    services = [f"{RELEASE}-{name}" for name in ("rollout-manager", "model-registry", "gae", "replay-buffer",
                                                  "rollout-worker", "redis", "seaweedfs")]
    delete_and_recover(rehearsal, services, 300)
    redis_pod = rehearsal.cluster.pod(f"{RELEASE}-redis")

    def live_keys() -> list[str]:
        keys = rehearsal.exec(redis_pod, "redis-cli", "--scan", "--pattern", "ow:rb:*live").split()
        return rehearsal.exec(redis_pod, "redis-cli", "smembers", keys[0]).split() if keys else []

    # The trainer samples each fragment once and may just have drained the index: wait for the next.
    live = wait_until(live_keys, 120, "a live fragment in the index after the stores came back")
    script = (
        "import os, sys; from overworld.core.blobs.urls import open_blob_store\n"
        "store = open_blob_store(os.environ['OVERWORLD_BLOBS'])\n"
        "missing = 0\n"
        "for key in sys.argv[1:]:\n"
        "    try: store.get(key)\n"
        "    except Exception: missing += 1\n"
        "print(missing)"
    )
    front = rehearsal.cluster.pod(f"{RELEASE}-replay-buffer")  # it has the store's address and keys
    assert rehearsal.exec(front, "python", "-c", script, *live[:50]).strip() == "0"


def test_deleting_the_ray_head_and_a_ray_worker_once(rehearsal: Rehearsal) -> None:
    """The RayCluster gets a new head and worker (new addresses, empty disks), the job is submitted
    again, and the trainer resumes from its newest checkpoint in the object store."""
    cluster = rehearsal.cluster
    cluster_name = rehearsal.rayjob()["status"]["rayClusterName"]
    owner = next(name for name in cluster.workloads if name.startswith(f"{cluster_name}-worker"))
    version, steps = progress(rehearsal)
    victims = [cluster.pod(f"{cluster_name}-head"), cluster.pods_of(owner)[0]]
    for thread in [cluster.delete_pod(p, wait=False) for p in victims]:
        thread.join()
    wait_progress_beyond(rehearsal, version, steps, 600, "after deleting the Ray head and a Ray worker")


# --- resume with kubectl, through the run-controller ------------------------------------------------


def test_kubectl_resume_replaces_the_trainer_and_continues_from_its_checkpoint(rehearsal: Rehearsal) -> None:
    cluster = rehearsal.cluster
    old = rehearsal.rayjob()
    old_name = old["metadata"]["name"]
    old_pods = [p for p in cluster.pods if p.owner.startswith(old["status"]["rayClusterName"])]
    version, steps = progress(rehearsal)
    patched = time.monotonic()
    cluster.kubectl("patch", "trainingrun", RELEASE, "--type", "merge", "-p",
                    json.dumps({"spec": {"resumeFrom": "latest"}}))

    def new_job() -> dict[str, object] | None:
        status = rehearsal.training_run().get("status") or {}
        return rehearsal.rayjob(status["rayJob"]) if status.get("rayJob") not in (None, old_name) else None

    try:
        job = wait_until(new_job, 300, "the next attempt's RayJob")
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{cluster.logs(CONTROLLER_LOGS, tail=4000)}") from err
    assert job["spec"]["entrypoint"].endswith("--resume latest")
    # The old trainer ended by itself: Ray did not wait out RAY_JOB_STOP_WAIT_TIME_S to SIGKILL it (a
    # driver aborted by Ray's signal handler, or a zombie under the head's PID 1, made every resume wait).
    # (Ray's stop wait at the chart's default grace)
    assert time.monotonic() - patched < stop_seconds({})[1], cluster.logs(old["status"]["rayClusterName"])[-6000:]
    # The old trainer was gone before the new RayJob existed: no two trainers of one run at once. (The
    # API server holds the new RayJob before KubeRay's next reconcile sees it: wait for that.)
    wait_until(lambda: any(kind == "rayjob-seen" and what == job["metadata"]["name"] for _, kind, what in cluster.events),
               60, "KubeRay seeing the next attempt's RayJob")
    seen = {what: at for at, kind, what in cluster.events if kind == "rayjob-seen"}
    assert all(p.ended and p.ended <= seen[job["metadata"]["name"]] for p in old_pods), [
        (p.name, p.ended) for p in old_pods]
    # It stopped through Ray's job API (KubeRay's finalizer) and checkpointed on the way out; the new
    # trainer resumed from the newest checkpoint in the object store, and counts on.
    status = wait_until(lambda: (s := rehearsal.trainer_status()).state == "running" and s.resumed_from and s,
                        300, "the new trainer resumed")
    assert status.resumed_from.startswith("iter-")
    assert int(status.start_model_version) >= version and int(status.start_env_steps) >= steps
    # That checkpoint, and the trainer's logs, are in the object store at the chart's save path.
    head_env = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    save_path = next(e["value"] for e in head_env if e["name"] == "OVERWORLD_SAVE_PATH")
    assert save_path.startswith("s3://"), save_path
    keys = rehearsal.object_keys(save_path)
    # keep_interval 0 keeps only the newest: the new trainer may have replaced the one it resumed from.
    kept = {m.group(1) for key in keys if (m := re.search(r"/checkpoints/(iter-\d+)/", key))}
    assert kept and max(kept) >= status.resumed_from, sorted(kept)
    assert any("/logs/" in key for key in keys), keys[:50]
    wait_progress_beyond(rehearsal, int(status.model_version), int(status.env_steps), 240, "after the resume")


CONTROLLER_LOGS = f"{RELEASE}-run-controller"



# --- every dashboard panel shows data ---------------------------------------------------------------

# The queries that return nothing while all is well (their counters are born at the first event), and
# the fault the test causes to fill each.
EMPTY_WHILE_WELL = {
    "overworld-services / Send queue and env restarts / B": "an environment process of the rollout worker killed",
    "overworld-training / Buffer drops and rejects / B": "a malformed fragment sent with a worker's certificate",
}
PICTURE_DATA = REPO / "output" / "rehearsal"  # what `make dashboard-picture` draws docs' picture from


def kill_env_process(rehearsal: Rehearsal) -> None:
    """SIGKILL the rollout worker's environment process (a spawned multiprocessing child)."""
    worker = rehearsal.cluster.pod(WORKERS)

    def spawned() -> list[int]:
        pids = subprocess.run(["ip", "netns", "pids", worker.host.netns], capture_output=True, text=True,
                              check=True).stdout.split()
        return [int(pid) for pid in pids  # spawn_main: not the resource tracker
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]

    (pid,) = wait_until(spawned, 60, f"{worker.name}'s environment process (started again after a kill)")
    os.kill(pid, signal.SIGKILL)


def insert_malformed_fragment(rehearsal: Rehearsal) -> None:
    """A worker (its certificate) sends a fragment of the wrong length: the replay buffer rejects it."""
    import grpc

    from overworld.core.security import tls
    from overworld.replay_buffer.client import ReplayBufferClient
    from overworld.v1 import common_pb2, replay_buffer_pb2

    cert, key, ca = tls.CredentialFiles(rehearsal.identity("rollout-worker")).pems
    front = rehearsal.cluster.pod(BUFFER)
    address = rehearsal.cluster.forward(front.ip, SERVICE_PORTS["replay-buffer"])
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert),
                             options=[("grpc.ssl_target_name_override", tls.server_name("replay-buffer"))]) as channel:
        buffer = ReplayBufferClient(address, channel=channel)  # through the port-forward, as that worker
        header = common_pb2.FragmentHeader(worker_id="rehearsal-faulty-worker", length=1)
        request = replay_buffer_pb2.InsertRequest(fragment=common_pb2.Fragment(header=header))
        with pytest.raises(grpc.RpcError) as refused:
            list(buffer.call("Insert", iter([request]), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value


def test_every_dashboard_query_shows_data(rehearsal: Rehearsal) -> None:
    """Every query of every panel of every dashboard the chart ships, as Grafana runs it (the dashboard's
    namespace and release variables, $__rate_interval), returns series from the rehearsal's Prometheus
    over the run. The ones empty while all is well (EMPTY_WHILE_WELL) show the faults this test causes,
    each twice, as a rate above 0. The training dashboard's series are saved for docs' picture."""
    from rehearsal.dashboard_picture import draw
    from rehearsal.dashboards import capture, dashboard_files, queries, rate_interval, run_range
    from rehearsal.training_rehearsal import SCRAPE_INTERVAL

    prometheus = rehearsal.prometheus
    step = SCRAPE_INTERVAL
    variables = {"namespace": NAMESPACE, "release": RELEASE, "__rate_interval": rate_interval(SCRAPE_INTERVAL, step)}
    every = [q for path in dashboard_files() for q in queries(path)]
    assert set(EMPTY_WHILE_WELL) <= {q.name for q in every}, sorted(q.name for q in every)
    counters = {name: f'sum({name}{{namespace="{NAMESPACE}", overworld_release="{RELEASE}"}})'
                for name in ("overworld_env_restarts_total", "overworld_replay_buffer_rejects_total")}
    before = {name: prometheus.value(expr) or 0.0 for name, expr in counters.items()}
    for round_ in (1, 2):
        kill_env_process(rehearsal)
        insert_malformed_fragment(rehearsal)
        wait_until(lambda r=round_: all((prometheus.value(e) or 0.0) >= before[n] + r for n, e in counters.items()),
                   120, f"fault round {round_} scraped")
    wait_until(lambda: all(any(float(v) > 0 for s in run_range(prometheus, q, variables, time.time() - 120, time.time(), step)
                               for _, v in s["values"]) for q in every if q.name in EMPTY_WHILE_WELL),
               120, f"{sorted(EMPTY_WHILE_WELL)} above 0")

    def empty() -> list[str]:
        return [q.name for q in every if not run_range(prometheus, q, variables, prometheus.started, time.time(), step)]

    # a counter born by the faults has a rate once two scrapes fall in one window of the range's grid
    try:
        wait_until(lambda: not empty(), 60, "every query returning series over the run")
    except TimeoutError as err:
        raise AssertionError(f"queries that returned no series: {empty()}") from err
    end = time.time()
    PICTURE_DATA.mkdir(parents=True, exist_ok=True)
    for path in dashboard_files():
        data = capture(prometheus, path, variables, prometheus.started, end, step)
        (PICTURE_DATA / f"{path.stem}.json").write_text(json.dumps(data))
        draw(data, PICTURE_DATA / f"{path.stem}.png")
