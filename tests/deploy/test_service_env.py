"""Each service's flags and environment, three ways that must agree: what the service reads (its parser
in overworld/serve/<service>.py, probed: a variable counts when setting it changes a flag's
default; plus the variables its module declares it reads), what docs/architecture.md's table says
it reads, and what the Helm chart gives it (every OVERWORLD_* variable of its Deployment, of the
TrainingRun and of the RayJob made from it for the trainer)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
from typing import Any
from unittest import mock

import pytest

from overworld import serve
from overworld.run_controller.rayjob import build_rayjob
from tests.deploy.deploy_support import (
    ARCHITECTURE,
    CI_VALUES,
    by_kind,
    containers,
    render,
    values_from_files,
)

GRPC_SERVICES = ("rollout-manager", "replay-buffer", "gae", "model-registry", "trainer", "rollout-worker")
ALL_SERVICES = (*GRPC_SERVICES, "run-controller")
PROBES = {int: "7", float: "7.5", None: "probe"}


def flags(service: str) -> dict[str, argparse.Action]:
    """--flag -> its action, for the flags the service's --help shows."""
    return {option: action for action in serve.parser(service)._actions  # noqa: SLF001
            for option in action.option_strings
            if option.startswith("--") and option != "--help" and action.help != argparse.SUPPRESS}


def flag_variables(service: str) -> set[str]:
    """The OVERWORLD_<FLAG> variables that change a default of the service's parser."""
    found = set()
    for option, action in flags(service).items():
        variable = "OVERWORLD_" + option[2:].upper().replace("-", "_")
        probe = "1" if isinstance(action, argparse._StoreTrueAction) else PROBES.get(action.type, "probe")  # noqa: SLF001
        with mock.patch.dict(os.environ, {variable: probe}):
            changed = serve.parser(service).get_default(action.dest)
        if changed != serve.parser(service).get_default(action.dest):
            found.add(variable)
    return found


def reads(service: str) -> set[str]:
    return flag_variables(service) | set(serve.environment(service))


def documented() -> dict[str, tuple[set[str], set[str]]]:
    """docs/architecture.md's "Configuration of a service": service -> (flags, variables) it reads."""
    text = ARCHITECTURE.read_text()
    table = text[text.index("## Configuration of a service"):text.index("## Metrics")]
    out: dict[str, tuple[set[str], set[str]]] = {s: (set(), set()) for s in ALL_SERVICES}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        used_by = re.sub(r"\([^)]*\)", "", cells[1])  # "all (and `overworld status`, ...)": not services
        users = set(re.findall("|".join(ALL_SERVICES), used_by))
        if used_by.strip().startswith("all"):
            users |= set(GRPC_SERVICES)
        assert users, f"no service in {cells[1]!r}"
        for service in users:
            out[service][0].update(n for n in names if n.startswith("--"))
            out[service][1].update(n for n in names if re.fullmatch(r"[A-Z][A-Z0-9_]+", n))
    return out


@pytest.mark.parametrize("service", ALL_SERVICES)
def test_the_docs_list_exactly_the_flags_and_variables_each_service_reads(service: str) -> None:
    documented_flags, documented_variables = documented()[service]
    assert documented_flags == set(flags(service)), (
        f"{service}: documented but not a flag {sorted(documented_flags - set(flags(service)))}; "
        f"a flag not documented {sorted(set(flags(service)) - documented_flags)}")
    variables = reads(service)
    assert documented_variables <= variables, f"{service} does not read {sorted(documented_variables - variables)}"
    undocumented = {v for v in variables - documented_variables
                    if not any(f"OVERWORLD_{f[2:].upper().replace('-', '_')}" == v for f in documented_flags)}
    assert not undocumented, f"{service} reads, undocumented: {sorted(undocumented)}"


def test_a_flag_variable_is_found_by_probing() -> None:
    assert {"OVERWORLD_REGISTRY_CHUNK_BYTES", "OVERWORLD_BLOBS", "OVERWORLD_INSECURE"} <= flag_variables(
        "model-registry")
    assert "OVERWORLD_INDEX" not in reads("model-registry") and "OVERWORLD_SET" not in reads("rollout-manager")


def chart_environment(objects: list[dict[str, Any]]) -> dict[str, set[str]]:
    """service -> the OVERWORLD_* variables the rendered chart gives it."""
    out: dict[str, set[str]] = {s: set() for s in ALL_SERVICES}

    def add(service: str, env: list[dict[str, Any]]) -> None:
        out[service] |= {e["name"] for e in env if e["name"].startswith("OVERWORLD_")}

    for deployment in by_kind(objects, "Deployment").values():
        component = deployment["metadata"]["labels"].get("app.kubernetes.io/component")
        if component in out:
            for container in containers(deployment):
                add(component, container.get("env", []))
    for training_run in by_kind(objects, "TrainingRun").values():
        add("trainer", training_run["spec"]["env"])
        cluster = build_rayjob(training_run, attempt=1)["spec"]["rayClusterSpec"]
        for pod in [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]:
            for container in pod["spec"]["containers"]:
                add("trainer", container.get("env", []))
    return out


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=["defaults", *(p.stem for p in CI_VALUES)])
def test_the_chart_gives_each_service_only_what_it_reads(values_file: Any) -> None:
    given = chart_environment(render(values_from_files([values_file]) if values_file else None))
    if values_file is None:  # the default release deploys them all (a CI file may turn the controller off)
        assert all(given[s] for s in ALL_SERVICES), given
    for service, variables in given.items():
        assert variables <= reads(service), f"the chart gives {service} {sorted(variables - reads(service))}"


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=["defaults", *(p.stem for p in CI_VALUES)])
def test_the_chart_gives_each_service_flags_it_has(values_file: Any) -> None:
    """Each Deployment's `serve SERVICE ...` arguments (extraArgs included) and the trainer's RayJob
    entrypoint parse with that service's parser."""
    objects = render(values_from_files([values_file]) if values_file else None)
    for deployment in by_kind(objects, "Deployment").values():
        component = deployment["metadata"]["labels"].get("app.kubernetes.io/component")
        for container in containers(deployment):
            if component in GRPC_SERVICES:
                assert container["args"][:2] == ["serve", component]
                serve.parse(component, container["args"][2:])
            elif component == "run-controller":
                assert container["command"] == ["python", "-m", "overworld.run_controller"]
                serve.parse(component, container["args"])
    for training_run in by_kind(objects, "TrainingRun").values():
        entrypoint = shlex.split(build_rayjob(training_run, attempt=1)["spec"]["entrypoint"])
        assert entrypoint[:4] == ["exec", "overworld", "serve", "trainer"], entrypoint
        serve.parse("trainer", entrypoint[4:])
