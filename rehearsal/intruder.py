"""A pod trying the run's services over the pod network (issue 16's and 23's "Done when", in the
rehearsal). Run inside a network namespace of its own on the rehearsal's bridge:

    ip netns exec NS python rehearsal/intruder.py SPEC.json

SPEC: {"reach": {name: "ip:port"}, "targets": {pod: [service kind, "ip:port"]}, "other_ca": dir,
       "stolen": {identity: dir}, "ray_dashboard": "ip:8265", "redis": "ip:6379"}, every key optional.
Prints JSON: whether a TCP connection to each "reach" address gets through (open, refused, dropped:
a NetworkPolicy); per target the status code of a plaintext health check and of one with a
certificate of another CA; per stolen identity and target the (code, details) of every method of
that service the identity may not call; the Ray Jobs API's HTTP status without a token and with a
wrong one; Redis' answer to a command without its password.
"""

from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from overworld.core.security import authz, tls

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's rehearsal package
from rehearsal.rpcs import RPCS, call_raw  # noqa: E402 (the services' methods, by identity)


def health(channel: grpc.Channel) -> str:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as err:
        return err.code().name
    return "OK"


def secure(address: str, directory: str, service: str) -> grpc.Channel:
    """A channel as the identity in `directory`, to `service` (the certificate its server must show)."""
    cert, key, ca = tls.CredentialFiles(Path(directory)).pems
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert),
                               options=[("grpc.ssl_target_name_override", tls.server_name(service))])


def jobs_api(address: str, token: str | None) -> int:
    request = urllib.request.Request(f"http://{address}/api/jobs/")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def redis_without_password(address: str) -> str:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"GET ow\r\n")
        return connection.recv(200).decode(errors="replace").split()[0]


def reach(address: str) -> str:
    """Whether a TCP connection gets through: "open", "refused" (nothing listens), or "dropped"
    (no answer at all: a NetworkPolicy)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "dropped"


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out: dict[str, Any] = {"reach": {name: reach(address) for name, address in (spec.get("reach") or {}).items()}}
    if "redis" in spec:
        out["redis"] = redis_without_password(spec["redis"])
    if "targets" not in spec:
        print(json.dumps(out))
        return 0
    out.update({"plaintext": {}, "other_ca": {}, "denied": {}})
    for pod, (service, address) in spec["targets"].items():
        with grpc.insecure_channel(address) as channel:
            out["plaintext"][pod] = health(channel)
        with secure(address, spec["other_ca"], service) as channel:
            out["other_ca"][pod] = health(channel)
    for identity, directory in spec["stolen"].items():
        answers: dict[str, list[Any]] = {}
        for pod, (service, address) in spec["targets"].items():
            with secure(address, directory, service) as channel:
                for rpc in RPCS:
                    if rpc.service == service and not authz.allowed(identity, rpc.path):
                        code, details = call_raw(channel, rpc, [b""], 5)
                        answers[f"{pod} {rpc.path}"] = [code.name, details]
        out["denied"][identity] = answers
    out["ray_jobs_api"] = {"no token": jobs_api(spec["ray_dashboard"], None),
                           "wrong token": jobs_api(spec["ray_dashboard"], "0" * 44)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
