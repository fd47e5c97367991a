"""The Helm chart: strict lint, render with every CI values file, strict schema validation of
every object, and the wiring between objects (names, ports, labels, secrets)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from overworld.run_controller.rayjob import build_rayjob
from rehearsal.pods import image_entrypoint
from tests.deploy.deploy_support import (
    ARCHITECTURE,
    CHART,
    CI_VALUES,
    CUSTOM_KINDS,
    KUBE_VERSIONS,
    REPO,
    SERVICES,
    by_kind,
    chart_crds,
    containers,
    custom_schemas,
    parse_manifests,
    render,
    render_files,
    validate_object,
    values_from_files,
)

CI_IDS = [path.stem for path in CI_VALUES]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
        if expr["operator"] == "NotIn" and labels.get(expr["key"]) in expr["values"]:
            return False
        if expr["operator"] == "Exists" and expr["key"] not in labels:
            return False
        if expr["operator"] == "DoesNotExist" and expr["key"] in labels:
            return False
    return True


@pytest.fixture(scope="module")
def default_objects() -> list[dict[str, Any]]:
    return render()


def test_ci_values_files_exist() -> None:
    assert len(CI_VALUES) >= 5, "deploy/helm/overworld/ci/ holds the values files the tests render"


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=["no-values", *CI_IDS])
def test_helm_lint_strict(values_file: Any) -> None:
    values = values_from_files([values_file]) if values_file else None
    for kube_version in ("v1.27.0", "v1.33.0"):
        report = helm_python.lint(CHART, values, strict=True, namespace="rl", kube_version=kube_version)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"] and not problems, json.dumps(report, indent=1)
        assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_every_rendered_object_is_valid(values_file: Any, kube_version: str) -> None:
    objects = render(values_from_files([values_file]))
    assert objects
    kinds = set()
    for obj in objects:
        kinds.add(obj["kind"])
        try:
            validate_object(obj, kube_version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {kube_version}: {exc}"
            )
    assert "Deployment" in kinds


def test_custom_resources_are_all_checked() -> None:
    """Each custom kind the chart can render has a schema, and the monitoring values render them all."""
    objects = render(values_from_files([CHART / "ci" / "monitoring-values.yaml"]))
    rendered_custom = {(o["apiVersion"], o["kind"]) for o in objects if "." in o["apiVersion"].split("/")[0]}
    rendered_custom -= {("apps/v1", "Deployment")}
    rendered_custom = {k for k in rendered_custom if not k[0].startswith(("rbac.", "networking.", "policy"))}
    assert rendered_custom == {
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
        ("overworld.dev/v1alpha1", "TrainingRun"),
    }
    assert set(custom_schemas()) >= CUSTOM_KINDS


def test_crd_is_valid_and_printer_columns_exist() -> None:
    (crd,) = chart_crds()
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(crd, version, strict=True)
    assert crd["metadata"]["name"] == "trainingruns.overworld.dev"
    (served,) = crd["spec"]["versions"]
    assert served["name"] == "v1alpha1" and served["subresources"] == {"status": {}}
    status_props = served["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    columns = {c["name"]: c["jsonPath"] for c in served["additionalPrinterColumns"]}
    for name in ("Phase", "Attempt", "Model Version", "Env Steps", "Latest Checkpoint"):
        path = columns[name]
        assert path.startswith(".status."), path
        assert path.removeprefix(".status.") in status_props, f"printer column {name} shows a missing field"
    spec_props = served["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for field in ("image", "resumeFrom", "trainerArgs", "workerGroup"):
        assert field in spec_props
    assert set(spec_props["workerGroup"]["properties"]) >= {"replicas", "gpus"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicaCount": 3}, "additional properties 'replicaCount'"),
        ({"rolloutWorker": {"replicas": 3}}, "additional properties 'replicas'"),
        ({"replayBuffer": {"replicaCount": "two"}}, "replicaCount"),
        ({"objectStore": {"bucket": "Bad_Bucket"}}, "bucket"),
        ({"externalRedis": {"url": "http://redis:6379"}}, "url"),
        ({"trainer": {"rayVersion": "latest"}}, "rayVersion"),
        ({"rolloutWorker": {"pdb": {"create": True, "maxUnavailable": "lots"}}}, "maxUnavailable"),
        ({"redis": {"appendfsync": "sometimes"}}, "appendfsync"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmError, match=message):
        render_files(values)


@pytest.mark.parametrize(("values", "fsync"), [({}, "always"), ({"redis": {"appendfsync": "everysec"}}, "everysec")])
def test_redis_syncs_its_log_before_it_acknowledges(values: dict[str, Any], fsync: str) -> None:
    """By default Redis fsyncs its append-only file before it answers a write, so a fragment the replay
    buffer acknowledged survives a crash of the Redis node (the promise of docs/architecture.md); the
    tests' redis-server runs so too (tests/support.py). `everysec` is there to be chosen, documented."""
    redis = by_kind(render(values), "StatefulSet")["overworld-redis"]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    script = container["args"][0]
    assert f"--appendonly yes --appendfsync {fsync} " in script, script


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"seaweedfs": {"enabled": False}}, "externalS3.endpoint"),
        (
            {"seaweedfs": {"enabled": False}, "externalS3": {"endpoint": "https://s3"}},
            "externalS3.existingSecret",
        ),
        ({"redis": {"enabled": False}}, "externalRedis.url or externalRedis.existingSecret"),
    ],
)
def test_external_stores_need_their_endpoints(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render_files(values)


def architecture_env_names() -> set[str]:
    return set(re.findall(r"`(OVERWORLD_[A-Z0-9_]+)`", ARCHITECTURE.read_text()))


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_services_use_the_documented_flags(values_file: Any) -> None:
    """Every OVERWORLD_* variable given to a service or the trainer is one of docs/architecture.md."""
    documented = architecture_env_names()
    assert {"OVERWORLD_PORT", "OVERWORLD_ROLLOUT_MANAGER", "OVERWORLD_BLOBS"} <= documented
    objects = render(values_from_files([values_file]))
    seen: set[str] = set()
    for obj in objects:
        component = obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        if obj["kind"] == "Deployment" and component in SERVICES:
            for container in containers(obj):
                seen |= {n for n in env_of(container) if n.startswith("OVERWORLD_")}
        if obj["kind"] == "TrainingRun":
            seen |= {e["name"] for e in obj["spec"]["env"] if e["name"].startswith("OVERWORLD_")}
    assert seen, "no OVERWORLD_ variables rendered"
    assert seen <= documented, f"not in docs/architecture.md: {sorted(seen - documented)}"


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_service_wiring(values_file: Any) -> None:
    """Addresses point at rendered Services and ports; secrets at rendered or existing Secrets."""
    values = values_from_files([values_file])
    objects = render(values)
    services = by_kind(objects, "Service")
    secrets = by_kind(objects, "Secret")
    deployments = by_kind(objects, "Deployment")
    existing = {
        s
        for s in (
            values.get("seaweedfs", {}).get("auth", {}).get("existingSecret"),
            values.get("externalS3", {}).get("existingSecret"),
            values.get("externalRedis", {}).get("existingSecret"),
        )
        if s
    }

    def check_address(address: str) -> None:
        host, port = address.rsplit(":", 1)
        assert host in services, f"{address}: no Service {host}"
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], address

    envs: list[dict[str, Any]] = []
    for name, deployment in deployments.items():
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        if component not in SERVICES:
            continue
        (container,) = containers(deployment)
        assert "command" not in container, f"{name}: the image's entrypoint must run"
        assert container["args"][:2] == ["serve", component], name
        env = env_of(container)
        port = int(env["OVERWORLD_PORT"])
        assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in container["ports"]
        # Probes: kubelet's gRPC probe, plaintext without a client certificate, on the health-only port
        # (OVERWORLD_HEALTH_PORT); the gRPC port itself is mutual TLS.
        health = int(env["OVERWORLD_HEALTH_PORT"])
        assert health != port and {"name": "health", "containerPort": health, "protocol": "TCP"} in container["ports"]
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert container[probe]["grpc"] == {"port": health}, f"{name} {probe}"
        if component != "rollout-worker":
            check_address(f"{name}:{port}")
        envs.append(env)
    for training_run in by_kind(objects, "TrainingRun").values():
        envs.append({e["name"]: e.get("value", e.get("valueFrom")) for e in training_run["spec"]["env"]})
    for env in envs:
        for key in (
            "OVERWORLD_ROLLOUT_MANAGER",
            "OVERWORLD_REPLAY_BUFFER",
            "OVERWORLD_GAE",
            "OVERWORLD_MODEL_REGISTRY",
        ):
            if key in env:
                check_address(env[key])
        if isinstance(env.get("OVERWORLD_INDEX"), str):
            match = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", env["OVERWORLD_INDEX"])
            assert match, env["OVERWORLD_INDEX"]
            if values.get("redis", {}).get("enabled", True):
                check_address(f"{match[1]}:{match[2]}")
        if "OVERWORLD_BLOBS" in env:
            assert env["OVERWORLD_BLOBS"].startswith("s3://")
            endpoint = env["OVERWORLD_S3_ENDPOINT"]
            if values.get("seaweedfs", {}).get("enabled", True):
                check_address(endpoint.removeprefix("http://"))
        for value in env.values():
            if isinstance(value, dict) and "secretKeyRef" in value:
                ref = value["secretKeyRef"]
                if ref["name"] in secrets:
                    assert ref["key"] in secrets[ref["name"]]["data"], ref
                else:
                    assert ref["name"] in existing, f"Secret {ref['name']} is neither rendered nor existing"


def run_config_text(objects: list[dict[str, Any]]) -> str:
    """The run config file the rollout-manager reads (OVERWORLD_CONFIG), found by following its mount."""
    deployment = next(
        d
        for d in by_kind(objects, "Deployment").values()
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "rollout-manager"
    )
    (container,) = containers(deployment)
    config_path = env_of(container)["OVERWORLD_CONFIG"]
    mount = next(m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = by_kind(objects, "ConfigMap")[volume["configMap"]["name"]]
    text: str = config_map["data"][config_path.rsplit("/", 1)[1]]
    return text


def test_rollout_manager_gets_the_default_run_config(
    default_objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    from overworld.core.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text(run_config_text(default_objects))
    loaded = load_config(path)  # the services' own strict loader, as the rollout-manager runs it
    default = load_config(CHART / "files" / "run-config.yaml")
    default.run_id = "overworld"
    assert loaded == default
    assert loaded.task_name == "crafter-cow"


def test_a_users_run_config_replaces_the_default(tmp_path: Path) -> None:
    from overworld.core.config import load_config

    example = REPO / "examples" / "cartpole.yaml"
    path = tmp_path / "config.yaml"
    path.write_text(run_config_text(render({"run": {"config": yaml.safe_load(example.read_text())}})))
    expected = load_config(example)
    expected.run_id = "overworld"
    assert load_config(path) == expected  # no default key merged in, only the run id


def test_the_run_id_outlives_the_rollout_manager(tmp_path: Path) -> None:
    """Without a run_id in its config the rollout-manager makes one up at every start: a deleted
    pod would come back as a new run, with an empty replay index and no checkpoints to resume."""
    from overworld.core.config import load_config

    def run_id(values: dict[str, Any]) -> str:
        path = tmp_path / "config.yaml"
        path.write_text(run_config_text(render(values, release="cow")))
        return load_config(path).run_id

    assert run_id({}) == "cow"
    assert run_id({"run": {"id": "cow-2"}}) == "cow-2"
    assert run_id({"run": {"id": "ignored", "config": {"task_name": "t", "run_id": "mine"}}}) == "mine"


def test_gpu_workers() -> None:
    """GPU pods are placed by their nvidia.com/gpu limit (the device plugin's resource) and tolerate
    the GPU taint; no node label that only GPU feature discovery sets is required."""
    objects = render()
    gpu = by_kind(objects, "Deployment")["overworld-rollout-worker"]
    pod = gpu["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nodeSelector" not in pod
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (training_run,) = by_kind(objects, "TrainingRun").values()
    (group,) = build_rayjob(training_run, attempt=1)["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert "nodeSelector" not in group["template"]["spec"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in pod["volumes"])
    cpu = by_kind(render(values_from_files([CHART / "ci" / "cpu-values.yaml"])), "Deployment")
    worker = cpu["overworld-rollout-worker"]
    assert worker["spec"]["replicas"] == 2
    assert "nvidia.com/gpu" not in json.dumps(worker)
    assert "nodeSelector" not in worker["spec"]["template"]["spec"]


def test_replicas_follow_values() -> None:
    default = by_kind(render(), "Deployment")
    # kubectl scale owns the fleet size: the chart never declares it, so helm upgrade keeps it.
    assert "replicas" not in default["overworld-rollout-worker"]["spec"]
    assert default["overworld-replay-buffer"]["spec"]["replicas"] == 2
    handed_over = by_kind(render({"replayBuffer": {"replicaCount": None}, "gae": {"replicaCount": None}}),
                          "Deployment")
    assert "replicas" not in handed_over["overworld-replay-buffer"]["spec"]
    assert "replicas" not in handed_over["overworld-gae"]["spec"]
    objects = render(
        {
            "replayBuffer": {"replicaCount": 5},
            "gae": {"replicaCount": 3},
            "rolloutWorker": {"replicaCount": 7},
        }
    )
    deployments = by_kind(objects, "Deployment")
    assert deployments["overworld-replay-buffer"]["spec"]["replicas"] == 5
    assert deployments["overworld-gae"]["spec"]["replicas"] == 3
    assert deployments["overworld-rollout-worker"]["spec"]["replicas"] == 7
    for singleton in ("overworld-rollout-manager", "overworld-model-registry", "overworld-run-controller"):
        assert deployments[singleton]["spec"]["replicas"] == 1
        assert deployments[singleton]["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_security_context(values_file: Any) -> None:
    for obj in render(values_from_files([values_file])):
        if obj["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True, f"{obj['metadata']['name']}/{container['name']}"
            assert "resources" in container and container["resources"].get("requests"), container["name"]


def test_pod_disruption_budgets_select_their_pods() -> None:
    objects = render(values_from_files([CHART / "ci" / "overrides-values.yaml"]))
    deployments = by_kind(objects, "Deployment")
    pdbs = by_kind(objects, "PodDisruptionBudget")
    assert set(pdbs) == {"lab-rollout-worker", "lab-replay-buffer", "lab-gae", "lab-rollout-manager"}
    assert pdbs["lab-rollout-worker"]["spec"]["minAvailable"] == "50%"
    assert pdbs["lab-rollout-manager"]["spec"]["minAvailable"] == 1
    for name, pdb in pdbs.items():
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert selector_matches(pdb["spec"]["selector"], labels), name
        others = [d for n, d in deployments.items() if n != name]
        assert not any(
            selector_matches(pdb["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
            for d in others
        )


def test_network_policies_let_the_release_in() -> None:
    objects = render(values_from_files([CHART / "ci" / "monitoring-values.yaml"]))
    policies = by_kind(objects, "NetworkPolicy")
    deployments = by_kind(objects, "Deployment")
    training_run = next(iter(by_kind(objects, "TrainingRun").values()))
    job = next(iter(by_kind(objects, "Job").values()))
    clients = [
        *(d["spec"]["template"]["metadata"]["labels"] for d in deployments.values()),
        training_run["spec"]["podLabels"],  # the trainer's Ray pods
        job["spec"]["template"]["metadata"]["labels"],  # the bucket hook
    ]
    # the stores only from the components that use them: not from a rollout worker, for one
    users = {"redis": {"replay-buffer", "rollout-manager"},
             "object-store": {"replay-buffer", "model-registry", "rollout-manager", "trainer", "create-bucket"}}
    for component in (*SERVICES, "redis", "object-store"):
        policy = policies[f"overworld-{component}"]
        grpc_rule = policy["spec"]["ingress"][0]
        selector = grpc_rule["from"][0]["podSelector"]
        for labels in clients:
            allowed = component not in users or labels.get("app.kubernetes.io/component") in users[component]
            assert selector_matches(selector, labels) == allowed, (component, labels)
        assert not selector_matches(selector, {"app.kubernetes.io/instance": "someone-else"})
    # the weights stream only from rollout workers: a compromised trainer or gae pod cannot reach it
    weights_ports = {"model-registry": 50064, "rollout-worker": 50066}
    for component, port in weights_ports.items():
        rules = policies[f"overworld-{component}"]["spec"]["ingress"]
        (weights_rule,) = [r for r in rules if {"port": port, "protocol": "TCP"} in r["ports"]]
        assert weights_rule["ports"] == [{"port": port, "protocol": "TCP"}]
        for labels in clients:
            allowed = labels.get("app.kubernetes.io/component") == "rollout-worker"
            assert selector_matches(weights_rule["from"][0]["podSelector"], labels) == allowed, (component, labels)
    # the registry's publish port only from the trainer's pods (its Ray pods: the TrainingRun's podLabels)
    registry = by_kind(objects, "Deployment")["overworld-model-registry"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "publish", "containerPort": 50065, "protocol": "TCP"} in registry["ports"]
    assert {"name": "OVERWORLD_PUBLISH_PORT", "value": "50065"} in registry["env"]
    rules = policies["overworld-model-registry"]["spec"]["ingress"]
    (publish_rule,) = [r for r in rules if {"port": 50065, "protocol": "TCP"} in r["ports"]]
    assert publish_rule["ports"] == [{"port": 50065, "protocol": "TCP"}]
    admitted = [labels for labels in clients if selector_matches(publish_rule["from"][0]["podSelector"], labels)]
    assert admitted == [training_run["spec"]["podLabels"]], admitted
    metrics_rule = policies["overworld-gae"]["spec"]["ingress"][1]
    assert metrics_rule["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
    }
    assert metrics_rule["ports"] == [{"port": 9090, "protocol": "TCP"}]


def test_monitors_select_the_metrics_ports() -> None:
    objects = render(values_from_files([CHART / "ci" / "monitoring-values.yaml"]))
    (service_monitor,) = by_kind(objects, "ServiceMonitor").values()
    (pod_monitor,) = by_kind(objects, "PodMonitor").values()
    for monitor in (service_monitor, pod_monitor):
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selected = [
        s
        for s in by_kind(objects, "Service").values()
        if selector_matches(service_monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert {s["metadata"]["name"] for s in selected} == {
        "overworld-rollout-manager",
        "overworld-replay-buffer",
        "overworld-gae",
        "overworld-model-registry",
    }
    for service in selected:
        assert "metrics" in [p["name"] for p in service["spec"]["ports"]]
    worker = by_kind(objects, "Deployment")["overworld-rollout-worker"]["spec"]["template"]
    assert selector_matches(pod_monitor["spec"]["selector"], worker["metadata"]["labels"])
    assert "metrics" in [p["name"] for p in worker["spec"]["containers"][0]["ports"]]
    training_run = next(iter(by_kind(objects, "TrainingRun").values()))
    assert selector_matches(pod_monitor["spec"]["selector"], training_run["spec"]["podLabels"])
    rayjob = build_rayjob(training_run, attempt=1)
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "metrics" in [p["name"] for p in head["ports"]]
    for monitor, endpoints in ((service_monitor, "endpoints"), (pod_monitor, "podMetricsEndpoints")):
        relabel = monitor["spec"][endpoints][0]["relabelings"]
        assert {
            "action": "replace",
            "targetLabel": "overworld_release",
            "replacement": "overworld",
        } in relabel


def test_dashboards_are_configmaps_for_the_sidecar() -> None:
    objects = render(values_from_files([CHART / "ci" / "monitoring-values.yaml"]))
    dashboards = [
        c for c in by_kind(objects, "ConfigMap").values() if "grafana_dashboard" in c["metadata"]["labels"]
    ]
    assert len(dashboards) == 2
    titles: set[str] = set()
    for config_map in dashboards:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == "monitoring"
        assert config_map["metadata"]["annotations"]["grafana_folder"] == "Overworld"
        ((name, text),) = config_map["data"].items()
        assert name.endswith(".json")
        dashboard = json.loads(text)
        titles |= {p["title"] for p in dashboard["panels"]}
    for title in (
        "Env steps / s",
        "Episode return",
        "Policy lag",
        "Buffer fill",
        "Buffer drops and rejects",
        "Learner throughput",
        "Losses",
        "Model version",
        "Weight push latency",
        "Rollout workers",
        "GPU use",
    ):
        assert title in titles


def test_notes_print_the_scale_status_and_resume_commands() -> None:
    notes = render_files(values_from_files([CHART / "ci" / "overrides-values.yaml"]), namespace="lab-ns")[
        "overworld/templates/NOTES.txt"
    ]
    assert "kubectl -n lab-ns scale deployment/lab-rollout-worker --replicas=N" in notes
    assert "kubectl -n lab-ns get trainingrun" in notes
    assert (
        'kubectl -n lab-ns patch trainingrun cow-hunt --type merge -p \'{"spec":{"resumeFrom":"latest"}}\''
        in notes
    )


def test_images_and_naming_overrides() -> None:
    objects = render(values_from_files([CHART / "ci" / "overrides-values.yaml"]))
    deployments = by_kind(objects, "Deployment")
    assert set(deployments) == {
        "lab-rollout-manager",
        "lab-replay-buffer",
        "lab-gae",
        "lab-model-registry",
        "lab-rollout-worker",
        "lab-run-controller",
    }
    manager = containers(deployments["lab-rollout-manager"])[0]
    assert manager["image"] == (
        "registry.internal:5000/overworld-rl/overworld-services@sha256:"
        "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    )
    worker = containers(deployments["lab-rollout-worker"])[0]
    assert worker["image"] == "registry.internal:5000/overworld-rl/overworld-rollout-worker:0.1.0-cuda"
    assert worker["args"] == ["serve", "rollout-worker", "--flush-timeout", "10"]
    for obj in objects:
        assert obj["metadata"]["labels"]["team"] == "rl", obj["metadata"]["name"]
    (training_run,) = by_kind(objects, "TrainingRun").values()
    assert training_run["metadata"]["name"] == "cow-hunt"
    assert training_run["spec"]["resumeFrom"] == "ckpt-000120"
    assert training_run["spec"]["imagePullSecrets"] == ["regcred"]


def test_default_values_make_a_runnable_trainer(default_objects: list[dict[str, Any]]) -> None:
    """The rendered TrainingRun becomes a RayJob that is valid and carries the trainer's wiring."""
    (training_run,) = by_kind(default_objects, "TrainingRun").values()
    assert "resumeFrom" not in training_run["spec"]
    rayjob = build_rayjob(training_run, attempt=1, resume_from=training_run["spec"].get("resumeFrom", ""))
    rayjob["metadata"]["ownerReferences"] = [
        {"apiVersion": "overworld.dev/v1alpha1", "kind": "TrainingRun", "name": "overworld", "uid": "u-1"}
    ]
    validate_object(rayjob)
    assert rayjob["spec"]["entrypoint"] == "exec overworld serve trainer --ray-address auto --resume latest"
    assert rayjob["spec"]["backoffLimit"] == 2
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 180  # trainer's value
    assert (
        cluster["rayVersion"] == yaml.safe_load((CHART / "values.yaml").read_text())["trainer"]["rayVersion"]
    )
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == 2
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head["env"]}
    assert env["OVERWORLD_ROLLOUT_MANAGER"]["value"] == "overworld-rollout-manager:50051"
    assert {"name": "trainer", "containerPort": 50055, "protocol": "TCP"} in head["ports"]


def test_bucket_hook_job() -> None:
    objects = render()
    (job,) = by_kind(objects, "Job").values()
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "post-install,post-upgrade"
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/overworld-rl/overworld-services:0.1.0"
    script = container["args"][0]
    compile(script, "create-bucket", "exec")
    assert "store.make_bucket(bucket)" in script
    assert not by_kind(render({"objectStore": {"createBucket": False}}), "Job")


def test_checkpoint_storage_survives_uninstall() -> None:
    objects = render()
    for name in ("overworld-seaweedfs", "overworld-redis"):
        statefulset = by_kind(objects, "StatefulSet")[name]
        assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"] == {
            "whenDeleted": "Retain",
            "whenScaled": "Retain",
        }
    secret = by_kind(objects, "Secret")["overworld-s3"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (crd,) = chart_crds()
    assert (CHART / "crds").is_dir() and crd["kind"] == "CustomResourceDefinition"  # Helm never deletes crds/


def test_release_name_prefixes_every_object() -> None:
    objects = parse_manifests(render_files(release="cow", namespace="lab"))
    for obj in objects:
        assert obj["metadata"]["name"].startswith("cow"), obj["metadata"]["name"]
        assert obj["metadata"]["namespace"] == "lab"


def test_ray_version_matches_pyproject() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    match = re.search(r'"ray(?:\[[^\]]*\])?==([0-9.]+)"', pyproject)
    assert match, "pyproject.toml pins no ray version (ray==X.Y.Z)"
    assert yaml.safe_load((CHART / "values.yaml").read_text())["trainer"]["rayVersion"] == match[1]


def test_run_controller_rbac_is_namespaced_and_exact(default_objects: list[dict[str, Any]]) -> None:
    """The run-controller's Role names each resource and verb (no wildcard, no ClusterRole) and is its
    ServiceAccount's. That the Role grants every call the controller makes is shown by running it
    through RBAC (tests/run_controller/test_run_controller.py, and the rehearsal)."""
    (role,) = by_kind(default_objects, "Role").values()
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert not any(verb == "*" or resource == "*" for _, resource, verb in granted)
    assert not by_kind(default_objects, "ClusterRole")
    deployment = by_kind(default_objects, "Deployment")["overworld-run-controller"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == role["metadata"]["name"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "overworld.run_controller"]
    namespace_env = next(e for e in container["env"] if e["name"] == "OVERWORLD_NAMESPACE")
    assert namespace_env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


# --- what a first real install would hit ---------------------------------------------------------


def test_rollout_worker_runs_the_images_entrypoint() -> None:
    """The Minecraft worker image wraps `overworld` in `xvfb-run` (the game needs a display); a
    container `command` would replace that wrapper."""
    worker = containers(by_kind(render(), "Deployment")["overworld-rollout-worker"])[0]
    dockerfile = REPO / "docker" / "rollout-worker.Dockerfile"
    argv = worker.get("command") or image_entrypoint(dockerfile, "minecraft")
    argv = [*argv, *worker["args"]]
    assert argv[:5] == ["xvfb-run", "-a", "overworld", "serve", "rollout-worker"], argv
    runtime = [*(worker.get("command") or image_entrypoint(dockerfile, "runtime")), *worker["args"]]
    assert runtime[:3] == ["overworld", "serve", "rollout-worker"]


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_no_minio_image_and_a_published_object_store(values_file: Any) -> None:
    """MinIO stopped publishing free images in October 2025: nothing may pull one."""
    objects = render(values_from_files([values_file]))
    images = {
        c["image"]
        for obj in objects
        if obj["kind"] in ("Deployment", "StatefulSet", "Job")
        for c in obj["spec"]["template"]["spec"]["containers"]
    }
    assert not [image for image in images if "minio" in image], images
    store = by_kind(objects, "StatefulSet").get("overworld-seaweedfs")
    if store is not None:
        (container,) = containers(store)
        assert container["image"] == "ghcr.io/chrislusf/seaweedfs:4.42"
        assert container["command"] == ["weed"] and "-s3" in container["args"]
        assert {e["name"] for e in container["env"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


SCHEDULING = {
    "priorityClassName": "rl-high",
    "runtimeClassName": "nvidia",
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["rl"]}]}]}}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
}


def test_scheduling_knobs_reach_every_pod() -> None:
    components = ("rolloutManager", "rolloutWorker", "replayBuffer", "gae", "modelRegistry", "runController",
                  "redis", "seaweedfs")
    values: dict[str, Any] = {name: dict(SCHEDULING) for name in components}
    values["trainer"] = {"head": dict(SCHEDULING), "workerGroup": dict(SCHEDULING)}
    objects = render(values)
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"]
            for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    (training_run,) = by_kind(objects, "TrainingRun").values()
    cluster = build_rayjob(training_run, attempt=1)["spec"]["rayClusterSpec"]
    pods["ray-head"] = cluster["headGroupSpec"]["template"]["spec"]
    pods["ray-worker"] = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert len(pods) == 10
    for name, pod in pods.items():
        for key, value in SCHEDULING.items():
            assert pod.get(key) == value, (name, key)
    for obj in objects:
        validate_object(obj)


def test_resume_from_is_left_to_kubectl() -> None:
    """An empty trainingRun.resumeFrom is not rendered, so Helm never owns the field and a
    `kubectl patch ... resumeFrom` survives `helm upgrade` (server-side apply)."""
    (training_run,) = by_kind(render(), "TrainingRun").values()
    assert "resumeFrom" not in training_run["spec"]
    (pinned,) = by_kind(render({"trainingRun": {"resumeFrom": "latest"}}), "TrainingRun").values()
    assert pinned["spec"]["resumeFrom"] == "latest"


def test_replicated_fronts_are_reached_through_headless_services() -> None:
    """Clients balance over every replica (gRPC round_robin over DNS): the address they get must be
    a headless Service selecting the pods."""
    objects = render()
    services = by_kind(objects, "Service")
    deployments = by_kind(objects, "Deployment")
    worker_env = env_of(containers(deployments["overworld-rollout-worker"])[0])
    (training_run,) = by_kind(objects, "TrainingRun").values()
    trainer_env = {e["name"]: e.get("value") for e in training_run["spec"]["env"]}
    for variable, component in (("OVERWORLD_REPLAY_BUFFER", "replay-buffer"), ("OVERWORLD_GAE", "gae")):
        envs = [trainer_env] + ([worker_env] if variable in worker_env else [])
        for env in envs:
            host = env[variable].rsplit(":", 1)[0]
            service = services[host]
            assert service["spec"]["clusterIP"] == "None", host
            labels = deployments[f"overworld-{component}"]["spec"]["template"]["metadata"]["labels"]
            assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_a_container_that_exits_shows_its_last_log_lines_in_its_status(default_objects: list[dict[str, Any]]) -> None:
    """A service that refuses to run (exit 78: the user's generator raised) logs the user's traceback
    once; `kubectl describe pod` shows it as the container's termination message."""
    containers = [(obj["metadata"]["name"], c) for obj in default_objects
                  if obj["kind"] in ("Deployment", "StatefulSet")
                  and obj["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "overworld"
                  for c in obj["spec"]["template"]["spec"]["containers"]]
    assert len(containers) >= 5
    assert {name: c.get("terminationMessagePolicy") for name, c in containers} == {
        name: "FallbackToLogsOnError" for name, _ in containers}


def test_a_workers_flush_fits_in_its_grace_period() -> None:
    """A stopping worker (a spot node's preemption, a scale-down) flushes what it holds for its grace
    period less 20 s (the loop's stop, the last heartbeat, Deregister): the 30 s and 120 s clouds give."""
    for grace, flush in ((30, "10"), (120, "100"), (60, "40"), (10, "5")):
        objects = render({"rolloutWorker": {"terminationGracePeriodSeconds": grace}})
        worker = by_kind(objects, "Deployment")["overworld-rollout-worker"]["spec"]["template"]["spec"]
        assert worker["terminationGracePeriodSeconds"] == grace
        assert {"name": "OVERWORLD_FLUSH_TIMEOUT", "value": flush} in worker["containers"][0]["env"], grace
