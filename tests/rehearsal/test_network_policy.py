"""The chart's NetworkPolicies as the rehearsal enforces them (rehearsal/network_policy.py), on real
network namespaces with real listeners, in seconds: who gets through to a replay-buffer pod from which
namespace and on which port. And what the rehearsal does not enforce (egress rules, unknown selector
operators, unknown fields) is refused when the policies are read, never passed over."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from rehearsal.netns import Host, Network, remove_leftovers
from rehearsal.network_policy import NetworkPolicies, Peer, UnsupportedPolicy
from tests.deploy.deploy_support import by_kind, render

NAMESPACE = "rl"
PORTS = {"grpc": 50052, "metrics": 9090, "health": 8081}  # the replay-buffer's gRPC, metrics, probes

PROBE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def reach(address):
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "dropped"
addresses = json.loads(sys.argv[1])
with ThreadPoolExecutor(len(addresses)) as pool:
    print(json.dumps(dict(zip(addresses, pool.map(reach, addresses)))))
"""
LISTEN = """
import socket, sys, time
sockets = []
for port in sys.argv[1:]:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(port))); s.listen(64); sockets.append(s)
print("listening", flush=True)
while True:
    time.sleep(60)
"""


def chart_objects(metrics_from: dict[str, Any] | None) -> list[dict[str, Any]]:
    selector = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}} if metrics_from is None else metrics_from
    return render({"networkPolicy": {"enabled": True, "metricsNamespaceSelector": selector}}, namespace=NAMESPACE)


def pod_labels(objects: list[dict[str, Any]], component: str) -> dict[str, str]:
    labels: dict[str, str] = by_kind(objects, "Deployment")[f"overworld-{component}"]["spec"]["template"]["metadata"]["labels"]
    return labels


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    remove_leftovers()
    network = Network()
    network.create()
    try:
        yield network
    finally:
        network.destroy()


@pytest.fixture(scope="module")
def server(network: Network) -> Iterator[Host]:
    """A host listening on the replay-buffer's ports."""
    host = network.add_host("server")
    listener = subprocess.Popen(["ip", "netns", "exec", host.netns, sys.executable, "-c", LISTEN,
                                 *map(str, PORTS.values())], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "listening"
        yield host
    finally:
        listener.kill()
        listener.wait()


def reach(client: Host, server: Host) -> dict[str, str]:
    """Port name -> open | refused | dropped, from `client` to the server's ports."""
    addresses = [f"{server.address}:{port}" for port in PORTS.values()]
    out = subprocess.run(["ip", "netns", "exec", client.netns, sys.executable, "-c", PROBE, json.dumps(addresses)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    found = json.loads(out)
    return {name: found[f"{server.address}:{port}"] for name, port in PORTS.items()}


def test_namespaces_and_ports_as_the_charts_policies_say(network: Network, server: Host) -> None:
    """Enforced on a replay-buffer pod with the chart's policies (metrics from the `monitoring`
    namespace): a pod of the release in the same namespace reaches the gRPC port only; a pod with the
    same labels in another namespace reaches nothing (a podSelector alone selects its own namespace); a
    pod of `monitoring` reaches the metrics port only; a pod of a third namespace reaches nothing; the
    node reaches everything (the kubelet's probes). Metrics from every namespace (`{}`) admits the third
    namespace too, and still only on the metrics port."""
    clients = {name: network.add_host(name) for name in ("worker", "stranger", "monitor", "elsewhere", "node")}
    objects = chart_objects(None)
    peers = {"worker": Peer(clients["worker"].address, pod_labels(objects, "rollout-worker"), NAMESPACE, {}),
             "stranger": Peer(clients["stranger"].address, pod_labels(objects, "rollout-worker"), "elsewhere", {}),
             "monitor": Peer(clients["monitor"].address, {"app.kubernetes.io/name": "prometheus"}, "monitoring", {}),
             "elsewhere": Peer(clients["elsewhere"].address, {}, "elsewhere", {})}
    buffer = Peer(server.address, pod_labels(objects, "replay-buffer"), NAMESPACE, PORTS)
    try:
        NetworkPolicies.apply(server.netns, NetworkPolicies(objects, NAMESPACE).ruleset(
            buffer, [buffer, *peers.values()], clients["node"].address))
        found = {name: reach(host, server) for name, host in clients.items()}
        assert found == {
            "worker": {"grpc": "open", "metrics": "dropped", "health": "dropped"},
            "stranger": {"grpc": "dropped", "metrics": "dropped", "health": "dropped"},
            "monitor": {"grpc": "dropped", "metrics": "open", "health": "dropped"},
            "elsewhere": {"grpc": "dropped", "metrics": "dropped", "health": "dropped"},
            "node": {"grpc": "open", "metrics": "open", "health": "open"},
        }, found

        everywhere = chart_objects({})
        NetworkPolicies.apply(server.netns, NetworkPolicies(everywhere, NAMESPACE).ruleset(
            buffer, [buffer, *peers.values()], clients["node"].address))
        assert reach(clients["elsewhere"], server) == {"grpc": "dropped", "metrics": "open", "health": "dropped"}
    finally:
        for host in clients.values():
            network.remove_host(host)


def policy(**spec: Any) -> dict[str, Any]:
    return {"kind": "NetworkPolicy", "metadata": {"name": "p", "namespace": NAMESPACE},
            "spec": {"podSelector": {}, **spec}}


@pytest.mark.parametrize(("spec", "says"), [
    ({"policyTypes": ["Ingress", "Egress"], "egress": [{"to": [{"podSelector": {}}]}]}, "egress"),
    ({"policyTypes": ["Egress"]}, "egress"),
    ({"ingress": [{"from": [{"podSelector": {"matchExpressions": [
        {"key": "app", "operator": "Matches", "values": ["x"]}]}}]}]}, "operator 'Matches'"),
    ({"podSelector": {"matchExpressions": [{"key": "app", "operator": "In"}]}}, "In needs values"),
    ({"ingress": [{"from": [{"serviceAccountSelector": {}}]}]}, "peer"),
    ({"ingress": [{"ports": [{"port": 80, "hostPort": 80}]}]}, "port"),
], ids=["egress-rules", "egress-type", "unknown-operator", "in-without-values", "unknown-peer", "unknown-port-field"])
def test_what_the_rehearsal_does_not_enforce_is_refused(spec: dict[str, Any], says: str) -> None:
    with pytest.raises(UnsupportedPolicy, match=says):
        NetworkPolicies([policy(**spec)], NAMESPACE)
