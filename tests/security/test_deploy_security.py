"""The chart and the kustomize tree lock the run down: no fixed password anywhere in deploy/, every
secret only inside a Secret (never in a ConfigMap, an env value, an argument or a default), certificates
that the services accept (Helm-generated and cert-manager's), Ray with token authentication and its
ports open to the release's pods only."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from overworld.core.grpc_util import serve
from overworld.core.security import tls
from overworld.gae.client import GaeClient
from overworld.gae.server import GaeService
from overworld.run_controller.rayjob import build_rayjob
from overworld.v1 import gae_pb2, gae_pb2_grpc
from tests.deploy.deploy_support import (
    CHART,
    CI_VALUES,
    REPO,
    by_kind,
    render,
    validate_object,
    values_from_files,
)

IDENTITIES = ("rollout-manager", "rollout-worker", "replay-buffer", "gae", "model-registry", "trainer",
              "run-controller", "operator")


def secret_values(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Every value held by a rendered Secret (decoded), by where it lives."""
    out = {}
    for name, secret in by_kind(objects, "Secret").items():
        for key, value in (secret.get("data") or {}).items():
            out[f"{name}/{key}"] = base64.b64decode(value).decode()
    return out


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_secrets_live_only_in_secrets(values_file: Path) -> None:
    objects = render(values_from_files([values_file]))
    secrets = secret_values(objects)
    needles = {}
    for where, value in secrets.items():
        if "PRIVATE KEY" in value:  # a distinctive piece of each key, as it and as base64
            value = "".join(value.splitlines()[1:-1])[10:50]
        if len(value) >= 16 and "CERTIFICATE" not in value and "/access-key" not in where:
            needles[where] = value
    assert needles, "no generated secret rendered"
    for obj in objects:
        if obj["kind"] == "Secret":
            continue
        text = json.dumps(obj)
        for where, value in needles.items():
            assert value not in text, f"{where} appears in {obj['kind']}/{obj['metadata']['name']}"
    for obj in objects:  # and no container gets a credential as a plain value
        for container in _containers(obj):
            for item in container.get("env", []):
                if re.search(r"PASSWORD|SECRET|TOKEN|_KEY$", item["name"]):
                    assert "valueFrom" in item, (obj["metadata"]["name"], item)


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    template = spec.get("template") or spec.get("jobTemplate", {}).get("spec", {}).get("template")
    return list((template or {}).get("spec", {}).get("containers", []))


def test_generated_secrets_differ_between_installs() -> None:
    """Generated (random), not fixed: two installs share no password, key or CA."""
    first, second = (secret_values(render({})) for _ in range(2))
    for where in first:
        if not where.endswith("/access-key"):
            assert first[where] != second[where], f"{where} is the same in two installs"


def test_no_fixed_password_anywhere_in_deploy() -> None:
    """No committed file holds a credential: no .env file at all, and every YAML key that names a
    password, secret key or token is empty (generated or taken from a Secret). Templates are checked
    by rendering (test_generated_secrets_differ_between_installs)."""
    key = re.compile(r"^\s*-?\s*[\"']?([\w.-]*(?:password|secret[-_]?key|token)[\w.-]*)[\"']?\s*[:=]\s*(.*)$",
                     re.IGNORECASE)
    found = []
    for path in (REPO / "deploy").rglob("*"):
        if not path.is_file() or "secrets" in path.relative_to(REPO / "deploy").parts or "templates" in path.parts:
            continue
        if path.suffix == ".env":
            found.append(f"{path.relative_to(REPO)}: a committed env file")
        if path.suffix not in (".yaml", ".yml", ".json"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = key.match(line)
            if not m:
                continue
            name, value = m.group(1), m.group(2).split(" #")[0].strip().strip("\"'")
            if name.endswith(("Key", "key\"")) or value.lower() in ("", "true", "false", "{}", "[]", "null") \
                    or value.startswith(("{{", "$(", "valueFrom", "{")):
                continue
            found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_redis_is_locked_with_the_generated_password() -> None:
    objects = render({})
    redis = by_kind(objects, "StatefulSet")["overworld-redis"]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    script = " ".join(container["command"] + container["args"])
    assert "requirepass" in script and "$REDIS_PASSWORD" in script and "--requirepass" not in script
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "overworld-redis", "key": "redis-password"}
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]["name"] == "overworld-redis"  # the probes
    buffer = by_kind(objects, "Deployment")["overworld-replay-buffer"]
    benv = {e["name"]: e for e in buffer["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert benv["OVERWORLD_INDEX"]["value"] == "redis://overworld-redis:6379/0"  # no password in the URL
    assert benv["OVERWORLD_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "overworld-redis"


def test_every_process_has_its_own_identity() -> None:
    objects = render({})
    for name, deployment in by_kind(objects, "Deployment").items():
        component = name.removeprefix("overworld-")
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"overworld-tls-{component}", name
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["OVERWORLD_TLS_DIR"] == "/etc/overworld/tls"
    (run,) = by_kind(objects, "TrainingRun").values()
    rayjob = build_rayjob(run, attempt=1)
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}  # KubeRay's Ray token authentication
    templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    for template in templates:  # the driver and the Ray Train workers on every node: the trainer's identity
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "overworld-tls-trainer"
        container = template["spec"]["containers"][0]
        assert {"name": "OVERWORLD_TLS_DIR", "value": "/etc/overworld/tls"} in container["env"]
        assert {"name": "tls", "mountPath": "/etc/overworld/tls", "readOnly": True} in container["volumeMounts"]
    validate_object(rayjob)


def test_ray_ports_are_open_to_the_release_only() -> None:
    objects = render({})
    policies = by_kind(objects, "NetworkPolicy")
    (run,) = by_kind(objects, "TrainingRun").values()
    head_labels = build_rayjob(run, attempt=1)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    head_labels = {**head_labels, "ray.io/node-type": "head"}  # added by KubeRay
    ray = policies["overworld-ray"]["spec"]
    assert ray["podSelector"]["matchLabels"].items() <= head_labels.items()
    (from_release,) = ray["ingress"][0]["from"]
    assert from_release == {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "overworld",
                                                            "app.kubernetes.io/instance": "overworld"}}}
    assert "ports" not in ray["ingress"][0]  # all Ray ports, but only from the release's pods
    assert all(rule["ports"] == [{"port": 9090, "protocol": "TCP"}] for rule in ray["ingress"][1:])
    dashboard = policies["overworld-ray-dashboard"]["spec"]
    assert dashboard["podSelector"]["matchLabels"].items() <= head_labels.items()
    assert dashboard["ingress"][0]["ports"] == [{"port": 8265, "protocol": "TCP"}]


def test_cert_manager_certificates() -> None:
    objects = render(values_from_files([CHART / "ci" / "cert-manager-values.yaml"]))
    assert not [n for n in by_kind(objects, "Secret") if "-tls-" in n]  # cert-manager writes them
    certificates = by_kind(objects, "Certificate")
    for obj in [*certificates.values(), *by_kind(objects, "Issuer").values()]:
        validate_object(obj)
    assert certificates["overworld-ca"]["spec"]["isCA"] is True
    for identity in IDENTITIES:
        spec = certificates[f"overworld-tls-{identity}"]["spec"]
        assert spec["secretName"] == f"overworld-tls-{identity}" and spec["commonName"] == identity
        assert spec["uris"] == [f"spiffe://overworld/overworld/{identity}"]
        assert spec["issuerRef"]["name"] == "overworld-ca"
        assert (f"{identity}.overworld.internal" in spec.get("dnsNames", [])) == (identity not in ("run-controller", "operator"))
        assert "overworld.internal" not in spec.get("dnsNames", [])  # no name every service shares
    shared = render({"tls": {"certManager": {"enabled": True, "issuerRef": {"name": "lab-ca", "kind": "ClusterIssuer"}}}})
    assert not by_kind(shared, "Issuer")
    assert by_kind(shared, "Certificate")["overworld-tls-gae"]["spec"]["issuerRef"]["name"] == "lab-ca"


def test_tls_off_is_said_out_loud() -> None:
    objects = render({"tls": {"enabled": False}})
    assert not [n for n in by_kind(objects, "Secret") if "-tls-" in n]
    for name, deployment in by_kind(objects, "Deployment").items():
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        if name != "overworld-run-controller":
            assert env["OVERWORLD_INSECURE"] == "true" and "OVERWORLD_TLS_DIR" not in env


def test_helm_generated_certificates_work_with_the_services(tmp_path: Path) -> None:
    """Helm's genCA/genSignedCert certificates (RSA, the identity in the CN, no SPIFFE ID) through the
    real TLS and authorization code."""
    secrets = secret_values(render({}))
    for identity in ("gae", "trainer", "rollout-worker"):
        directory = tmp_path / identity
        directory.mkdir()
        for key in (tls.CERT, tls.KEY, tls.CA):
            (directory / key).write_text(secrets[f"overworld-tls-{identity}/{key}"])
    try:
        tls.use(tmp_path / "gae")
        server = serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")])
        for identity, expected in (("trainer", grpc.StatusCode.INVALID_ARGUMENT),
                                   ("rollout-worker", grpc.StatusCode.PERMISSION_DENIED)):
            tls.use(tmp_path / identity)
            with GaeClient(server.address) as gae, pytest.raises(grpc.RpcError) as err:
                gae.call("Estimate", gae_pb2.EstimateRequest(), timeout=10)
            assert err.value.code() == expected, err.value.details()
        server.stop(0)
    finally:
        tls.reset()


def test_kustomize_secrets_are_made_not_committed(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_secrets", REPO / "deploy/kustomize/make_secrets.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make(tmp_path / "a")
    module.make(tmp_path / "b")
    assert (tmp_path / "a/s3.env").read_text() != (tmp_path / "b/s3.env").read_text()
    assert oct((tmp_path / "a/tls/gae/tls.key").stat().st_mode & 0o777) == "0o600"
    kustomization = yaml.safe_load((REPO / "deploy/kustomize/base/kustomization.yaml").read_text())
    generated = {g["name"] for g in kustomization["secretGenerator"]}
    assert generated == {"overworld-s3", "overworld-redis", *(f"overworld-tls-{i}" for i in IDENTITIES)}
