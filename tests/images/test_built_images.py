"""The images as built here (`make rehearsal-images`: the Dockerfiles as users build them, with the
CPU-only torch), each container started as a kubelet starts it (rehearsal/container.py): the
image's root filesystem, entrypoint, cmd, env, working directory and user, merged with the container
spec, without a network.

Every Overworld container of the chart runs restricted: `runAsNonRoot`, all capabilities dropped, no
privilege escalation, a read-only root (the trainer's Ray pods excepted: Ray writes to its home) and
an emptyDir at /tmp. Here the pod names no runAsUser, so the image's USER decides and runAsNonRoot
checks it, as the kubelet does.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from overworld.run_controller.rayjob import RAY_GID, RAY_UID
from rehearsal import container
from rehearsal.oci_images import REPO, Image, ImageStore, reference
from rehearsal.pods import Security, Volume, run_as_non_root_refusal, security_of

pytestmark = pytest.mark.slow  # the images are built before the session (minutes from nothing)

sys.path.insert(0, str(REPO / "docker"))
from role_requirements import requirements  # noqa: E402

SERVICES_OF = {
    "services": ("rollout-manager", "replay-buffer", "gae", "model-registry", "run-controller"),
    "rollout-worker": ("rollout-worker",),
    "trainer": ("trainer",),
}
NOT_IN_ROLE = {"services": ("torch", "ray", "wandb", "tensorboard"), "rollout-worker": ("ray", "wandb", "kopf"),
               "trainer": ("kopf",)}
RESTRICTED = {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
SHELL_PROBE = """
import json, os, tempfile
def writable(path):
    try:
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False
mounts = sorted({line.split()[1] for line in open("/proc/self/mounts")})
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()), "home": os.environ.get("HOME"),
                  "cwd": os.getcwd(), "writable": [m for m in mounts if not m.startswith(("/proc", "/sys")) and writable(m)],
                  "root_writable": writable("/"), "home_writable": writable(os.environ.get("HOME", "/"))}))
"""


def pod(role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod spec and container spec an Overworld container of `role` runs with in the chart, less any
    runAsUser: the image's USER decides."""
    own = dict(RESTRICTED)
    if role == "trainer":  # the RayJob's pods (run_controller/rayjob.py) keep a writable root
        return {"securityContext": {"runAsNonRoot": True, "fsGroup": RAY_GID}}, {"securityContext": own}
    own["readOnlyRootFilesystem"] = True
    return {"securityContext": {"runAsNonRoot": True, "fsGroup": 10001}}, {"securityContext": own}


def volumes(tmp_path: Path) -> list[Volume]:
    """An emptyDir at /tmp (world-writable, as the kubelet makes one)."""
    tmp = tmp_path / "volume-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    tmp.chmod(0o1777)
    return [Volume("/tmp", "dir", tmp)]


def start(image: Image, role: str, tmp_path: Path, **spec: Any) -> tuple[Security, Any]:
    """Run one container of `role` from `image` with `spec` (command, args) to its end."""
    pod_spec, container_spec = pod(role)
    container_spec = {**container_spec, "image": image.reference, **spec}
    security = security_of(pod_spec, container_spec, image)
    refusal = run_as_non_root_refusal(security)
    assert not refusal, f"{image.reference}: the kubelet would not start it: {refusal}"
    done = container.run(image, container_spec, security, volumes(tmp_path), tmp_path / "container")
    return security, done


@pytest.mark.parametrize("role", ["services", "rollout-worker", "trainer"])
def test_runs_as_its_non_root_user_writing_only_its_volumes(image_store: ImageStore, role: str, tmp_path: Path) -> None:
    """runAsNonRoot admits the image's USER (numeric, not root: 10001, the trainer the RayJob pods'
    1000:100); with a read-only root the process can write its volumes and /dev/shm, nothing else."""
    image = image_store.image(reference(role))
    _, done = start(image, role, tmp_path, command=["python", "-c", SHELL_PROBE])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if role == "trainer":
        assert (seen["uid"], seen["gid"]) == (RAY_UID, RAY_GID)
        # Ray writes to its user's home (the RayJob pods keep a writable root)
        assert seen["home"] == "/home/ray" and seen["cwd"] == "/home/ray" and seen["home_writable"], seen
        return
    assert (seen["uid"], seen["gid"], seen["groups"]) == (10001, 10001, [10001])
    assert seen["writable"] == ["/dev/shm", "/tmp"] and not seen["root_writable"], seen
    assert seen["home"] == "/tmp" and seen["cwd"] == "/tmp"


@pytest.mark.parametrize(("role", "service"), [(r, s) for r, services in SERVICES_OF.items() for s in services])
def test_serve_help_through_the_entrypoint(image_store: ImageStore, role: str, service: str, tmp_path: Path) -> None:
    """`overworld serve X --help` for every service the image is for, as the chart starts it: the
    image's entrypoint with the container's args (the trainer: KubeRay's job runs `exec overworld
    serve trainer ...` under /bin/sh, so `overworld` on the image's PATH)."""
    image = image_store.image(reference(role))
    spec: dict[str, Any] = {"args": ["serve", service, "--help"]}
    if role == "trainer":
        spec = {"command": ["/bin/sh", "-c", f"exec overworld serve {service} --help"]}
    _, done = start(image, role, tmp_path, **spec)
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    assert f"usage: overworld serve {service}" in done.stdout, done.stdout[:1000]


VERSIONS_PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
names, absent = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"versions": {n: version(n) for n in names}, "importable": [a for a in absent if u.find_spec(a)]}))
"""


@pytest.mark.parametrize("role", ["services", "rollout-worker", "trainer"])
def test_holds_its_role_at_the_pinned_versions(image_store: ImageStore, role: str, tmp_path: Path) -> None:
    """Each requirement of the image's role is installed at exactly the version pyproject.toml pins
    (torch's CPU build counts as its version); the other roles' heavy packages are not there."""
    pins = {}
    for requirement in requirements(REPO / "pyproject.toml", role):
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==(\S+)", requirement)
        if match:
            pins[match[1].lower()] = match[2]
    image = image_store.image(reference(role))
    _, done = start(image, role, tmp_path, command=["python", "-c", VERSIONS_PROBE, json.dumps(sorted(pins)),
                                                    json.dumps(NOT_IN_ROLE[role])])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    installed = {name: (v or "").split("+")[0] or None for name, v in seen["versions"].items()}
    assert installed == pins, {n: (installed[n], pins[n]) for n in pins if installed[n] != pins[n]}
    assert seen["importable"] == [], f"{role} image holds {seen['importable']}"


@pytest.mark.parametrize("role", ["services", "rollout-worker", "trainer"])
def test_holds_the_package_as_checked_out(image_store: ImageStore, role: str) -> None:
    """Every module of the checkout's package, byte for byte, and nothing else: a module left out of
    an image (or an image built from other code) fails here."""
    image = image_store.image(reference(role))
    (site,) = (image.rootfs / "opt" / "overworld" / "lib").glob("python3*/site-packages")

    def modules(root: Path) -> dict[str, str]:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*.py")}

    in_image, checked_out = modules(site / "overworld"), modules(REPO / "services" / "overworld")
    assert sorted(set(checked_out) - set(in_image)) == [], "modules missing from the image"
    assert sorted(set(in_image) - set(checked_out)) == [], "modules in the image that the checkout lacks"
    assert [m for m in checked_out if in_image[m] != checked_out[m]] == [], "modules that differ from the checkout"


CRAFTER_PROBE = """
import json
from overworld.envs.crafter_cow import make_env
make_env().reset(seed=0)
from numba.core.registry import CPUDispatcher
import opensimplex.internals as internals
stats = {name: [sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values())]
         for name, f in vars(internals).items() if isinstance(f, CPUDispatcher) and f.signatures}
print(json.dumps(stats))
"""


def test_crafter_starts_on_a_read_only_root_without_compiling(image_store: ImageStore, tmp_path: Path) -> None:
    """A worker's environment resets on a read-only root with the world generation numba compiled at
    build time: every jitted function it calls is loaded from the baked cache, none compiled."""
    image = image_store.image(reference("rollout-worker"))
    _, done = start(image, "rollout-worker", tmp_path, command=["python", "-c", CRAFTER_PROBE])
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats, "Crafter's reset called no jitted function"
    compiled = {name: misses for name, (_, misses) in stats.items() if misses}
    assert not compiled, f"compiled at start (not in the image's numba cache): {compiled}"
    assert all(hits for hits, _ in stats.values()), stats


def test_trainer_has_what_kuberay_runs_in_it(image_store: ImageStore, tmp_path: Path) -> None:
    """KubeRay starts the Ray nodes with `/bin/bash -c 'ulimit -n 65536; ray start ...'` and probes them
    with `wget ... | grep success`; its rayVersion is the pinned Ray, which the image's `ray` must be;
    the image's USER is the RayJob pods' runAsUser and runAsGroup."""
    image = image_store.image(reference("trainer"))
    assert image.config.user == f"{RAY_UID}:{RAY_GID}"
    pinned = re.search(r'"ray\[[^\]]*\]==([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert pinned
    _, done = start(image, "trainer", tmp_path, command=["/bin/bash", "-c", "command -v wget && ray --version"])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"ray, version {pinned[1]}" in done.stdout, done.stdout
