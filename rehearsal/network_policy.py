"""NetworkPolicies enforced in the rehearsal as a CNI enforces them: a pod that some policy selects
accepts only what one of those policies' ingress rules allows, from the pods they select (a
`podSelector` alone: pods of the policy's own namespace; with a `namespaceSelector`: pods of the
namespaces it selects, by their `kubernetes.io/metadata.name` label) and the ipBlocks they name, on
the ports they name (a named port is the pod's container port of that name); a pod no policy selects
accepts everything. Replies to a pod's own connections, loopback, and the node (the kubelet's probes,
port-forwards: the control host here) are always accepted, as on a cluster.

What is not enforced here is refused when the policies are read, never passed over: a policy with
egress rules (`policyTypes: [Egress]` or an `egress` list; the chart declares none), a selector
operator other than In, NotIn, Exists and DoesNotExist, a peer or port field this module does not know.

Each pod's rules are an nftables table in its own network namespace, rewritten when the pods a rule
selects come or go. Services' `port` -> `targetPort` is honoured the same way, as kube-proxy does it:
a connection to a ClusterIP Service's pod on the Service's port is rewritten to the target port.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any

NAMESPACE_LABEL = "kubernetes.io/metadata.name"


OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
PEER_FIELDS = {"podSelector", "namespaceSelector", "ipBlock"}
PORT_FIELDS = {"port", "protocol", "endPort"}


class UnsupportedPolicy(ValueError):
    """A NetworkPolicy the rehearsal cannot enforce as a CNI would: refused, not half-enforced."""


def check_selector(selector: dict[str, Any] | None, where: str) -> None:
    """Refuse a label selector with a field or an operator that the API server would refuse or that
    :func:`matches` does not evaluate."""
    if selector is None:
        return
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise UnsupportedPolicy(f"{where}: unknown selector fields {sorted(unknown)}")
    for expression in selector.get("matchExpressions") or []:
        operator = expression.get("operator")
        if operator not in OPERATORS:
            raise UnsupportedPolicy(f"{where}: selector operator {operator!r} is not one of {', '.join(OPERATORS)}")
        if (operator in ("In", "NotIn")) != bool(expression.get("values")):
            raise UnsupportedPolicy(f"{where}: {operator} {'needs' if operator in ('In', 'NotIn') else 'takes no'} values")


def check_policy(policy: dict[str, Any]) -> None:
    """Refuse what :class:`NetworkPolicies` would not enforce as a CNI does (module docstring)."""
    name = f"NetworkPolicy {policy['metadata']['name']}"
    spec = policy["spec"]
    if "Egress" in (spec.get("policyTypes") or []) or spec.get("egress"):
        raise UnsupportedPolicy(f"{name}: egress rules are not enforced by the rehearsal (rehearsal/network_policy.py)")
    check_selector(spec.get("podSelector") or {}, f"{name} podSelector")
    for rule in spec.get("ingress") or []:
        for peer in rule.get("from") or []:
            if not peer or set(peer) - PEER_FIELDS:
                raise UnsupportedPolicy(f"{name}: peer {peer} (known: {sorted(PEER_FIELDS)})")
            check_selector(peer.get("podSelector"), f"{name} from.podSelector")
            check_selector(peer.get("namespaceSelector"), f"{name} from.namespaceSelector")
        for port in rule.get("ports") or []:
            if set(port) - PORT_FIELDS:
                raise UnsupportedPolicy(f"{name}: port {port} (known: {sorted(PORT_FIELDS)})")


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against labels; {} selects everything."""
    if selector is None:
        return False
    check_selector(selector, "selector")
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


@dataclass
class Peer:
    """A pod as the policies see it."""

    ip: str
    labels: dict[str, str]
    namespace: str
    ports: dict[str, int]  # container port name -> number


class NetworkPolicies:
    def __init__(self, objects: list[dict[str, Any]], namespace: str) -> None:
        self.namespace = namespace
        self.policies = [o for o in objects if o["kind"] == "NetworkPolicy"
                         and o["metadata"].get("namespace", namespace) == namespace]
        for policy in self.policies:
            check_policy(policy)
        self.services = [o for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP") != "None"]

    def _sources(self, rule: dict[str, Any], peers: list[Peer]) -> tuple[list[str], list[str]] | None:
        """The source addresses a rule admits and the ranges it excepts (None: any source)."""
        sources = rule.get("from")
        if not sources:
            return None
        out: list[str] = []
        excepted: list[str] = []
        for source in sources:
            if "ipBlock" in source:
                out.append(source["ipBlock"]["cidr"])
                excepted += source["ipBlock"].get("except") or []
                continue
            namespaces = source.get("namespaceSelector")
            pods = source.get("podSelector")
            for peer in peers:
                in_namespace = (peer.namespace == self.namespace if namespaces is None
                                else matches(namespaces, {NAMESPACE_LABEL: peer.namespace}))
                if in_namespace and (pods is None or matches(pods, peer.labels)):
                    out.append(peer.ip)
        return sorted(set(out)), sorted(set(excepted))

    def ruleset(self, pod: Peer, peers: list[Peer], node: str) -> str:
        """The nftables ruleset of one pod's namespace."""
        lines = ["table inet k8s", "delete table inet k8s", "table inet k8s {"]
        selecting = [p for p in self.policies if matches(p["spec"].get("podSelector") or {}, pod.labels)]
        if selecting:
            lines += ["  chain ingress {", "    type filter hook input priority 0; policy drop;",
                      "    iif lo accept", "    ct state established,related accept", f"    ip saddr {node} accept"]
            for policy in selecting:
                for rule in policy["spec"].get("ingress") or []:
                    sources = self._sources(rule, peers)
                    if sources is not None and not sources[0]:
                        continue  # it selects no pod now
                    match = ""
                    if sources is not None:
                        match = f"ip saddr {{ {', '.join(sources[0])} }} "
                        if sources[1]:
                            match += f"ip saddr != {{ {', '.join(sources[1])} }} "
                    ports = rule.get("ports")
                    if not ports:
                        lines.append(f"    {match}accept")
                    for port in ports or []:
                        protocol = port.get("protocol", "TCP").lower()
                        number = port.get("port")
                        number = pod.ports.get(number) if isinstance(number, str) else number
                        if "port" not in port:  # a protocol alone: every port of it
                            lines.append(f"    {match}meta l4proto {protocol} accept")
                        elif number is not None:
                            span = f"{number}-{port['endPort']}" if port.get("endPort") else str(number)
                            lines.append(f"    {match}{protocol} dport {span} accept")
            lines.append("  }")
        redirects = self._redirects(peers)
        if redirects:
            lines += ["  chain services {", "    type nat hook output priority -100; policy accept;",
                      *(f"    ip daddr {{ {', '.join(ips)} }} tcp dport {port} dnat ip to :{target}"
                        for ips, port, target in redirects), "  }"]
        lines.append("}")
        return "\n".join(lines) + "\n"

    def _redirects(self, peers: list[Peer]) -> list[tuple[list[str], int, int]]:
        """(Service's pods, port, targetPort) where they differ: kube-proxy's rewrite."""
        out = []
        for service in self.services:
            selector = service["spec"].get("selector") or {}
            backends = [p for p in peers if p.namespace == self.namespace and selector
                        and all(p.labels.get(k) == v for k, v in selector.items())]
            for port in service["spec"].get("ports") or []:
                target = port.get("targetPort", port["port"])
                for backend in backends:
                    number = backend.ports.get(target) if isinstance(target, str) else int(target)
                    if number is not None and number != port["port"]:
                        out.append(([backend.ip], int(port["port"]), number))
        return out

    @staticmethod
    def apply(netns: str, ruleset: str) -> None:
        subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=ruleset, text=True,
                       capture_output=True, check=True, timeout=30)

