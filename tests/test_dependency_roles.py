"""The dependency roles of pyproject.toml: each image installs its role's (docker/), and the services
image's (`dependencies` + the `services` extra) holds no torch, Ray or W&B: the services run in a venv
of that role alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from overworld.core.wire import weights

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "ray", "wandb", "tensorboard"}


def requirements(*roles: str) -> list[str]:
    """The requirements of `dependencies` plus the given extras, self-references (`overworld[...]`) followed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    out, todo, seen = list(project["dependencies"]), list(roles), set()
    while todo:
        role = todo.pop()
        if role in seen:
            continue
        seen.add(role)
        for requirement in extras[role]:
            own = re.fullmatch(r"overworld\[([^\]]+)\]", requirement)
            if own:
                todo.extend(own[1].split(","))
            elif requirement not in out:
                out.append(requirement)
    return out


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[=<>~!]", r, maxsplit=1)[0].lower() for r in requirements}


def test_each_role_has_what_its_image_needs_and_the_services_no_torch_ray_or_wandb() -> None:
    assert not names(requirements("services")) & HEAVY
    assert "kopf" in names(requirements("services"))
    worker, trainer = names(requirements("rollout-worker")), names(requirements("trainer"))
    assert {"torch", "crafter", "imageio-ffmpeg"} <= worker and not worker & {"ray", "wandb", "kopf"}
    assert {"torch", "ray", "wandb", "tensorboard", "crafter"} <= trainer and "kopf" not in trainer
    assert names(requirements("all")) == names(requirements("services", "rollout-worker", "trainer"))


@pytest.mark.slow
def test_the_services_run_in_a_venv_of_their_role_alone(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                *requirements("services")], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OVERWORLD_", "PYTHON"))}
    env["PYTHONPATH"] = str(ROOT / "services")
    workdir = tmp_path / "work"
    workdir.mkdir()
    probe = subprocess.run([python, str(ROOT / "tests" / "services_role_probe.py"), str(workdir)], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-5000:]
    report = json.loads(probe.stdout.strip().splitlines()[-1])
    assert report["importable"] == [] and report["imported"] == [], report
    assert all(report["help"].values()), report["help"]
    assert report["run_id"] and report["dtype"] == "bfloat16" and report["sha256_matches"]
    # what the registry sent is torch's own cast of what was published
    published = weights.from_bytes(bytes.fromhex(report["published"]))
    expected = {k: v.to(weights.half_dtype("bfloat16")) if v.is_floating_point() else v for k, v in published.items()}
    received = weights.from_bytes(bytes.fromhex(report["bfloat16"]))
    assert received.keys() == expected.keys()
    for key, tensor in expected.items():
        assert received[key].dtype == tensor.dtype and received[key].equal(tensor), key


def test_the_minestudio_venv_installs_every_runtime_dependency_of_overworld() -> None:
    """.venv-minestudio installs Overworld with --no-deps, so its requirements file must name each of
    `dependencies` itself (versions may differ where MineStudio caps them); a missing one fails only
    at the end of CI, after the whole main suite."""
    listed = names([line.strip() for line in (ROOT / ".ci" / "minestudio-requirements.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#")])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert names(project["dependencies"]) - listed == set()
