"""The GPU box `make gpu-check` plans for (issue 24): CPython 3.12 with a CUDA torch, grpcio, protobuf,
numpy, safetensors and prometheus-client (and what torch itself needs), nothing to download; everything
else travels as the wheels of bench/gpu/wheels.txt.

- On the box: `install_wheels` puts gpu-wheels/*.whl into .gpu-site/ (pip --target, no index), which
  goes first on the path, so the pinned gRPC/protobuf win over older ones the box may have.
- Here (the dry run, CI): `simulate` hides every installed distribution that is neither on the box nor
  in the wheel set, for this process and every process it starts (a sitecustomize module first on
  PYTHONPATH swaps site-packages for a view holding only the others): Ray, W&B, TensorBoard, numba, ...
  are then simply not found. A pipeline that needs one of them, or a wheel missing from wheels.txt,
  fails the dry run.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS_TXT = Path(__file__).with_name("wheels.txt")
WHEEL_DIR = ROOT / "gpu-wheels"
SITE = ROOT / ".gpu-site"
# The box as the issue describes it (beside the standard library, pip and setuptools).
BOX_PACKAGES = ("torch", "grpcio", "protobuf", "numpy", "safetensors", "prometheus-client", "pip", "setuptools")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_requirements() -> dict[str, str]:
    """wheels.txt: normalized name -> pinned version."""
    out = {}
    for line in WHEELS_TXT.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalize(name)] = version.strip()
    return out


def _requirements(dist: str) -> list[str]:
    """The distributions `dist` requires unconditionally (extras left out), by normalized name."""
    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
        return []
    names = []
    for req in reqs:
        if "extra ==" in req.replace('"', "'").replace("extra==", "extra =="):
            continue
        names.append(normalize(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]))
    return names


def box_distributions() -> set[str]:
    """The box's packages and everything they require, as installed here."""
    seen: set[str] = set()
    todo = [normalize(n) for n in BOX_PACKAGES]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_requirements(name))
    return seen


def hidden_distributions() -> list[str]:
    """Distributions installed here that would not be on the box: neither the box's nor the wheel set's."""
    allowed = box_distributions() | set(wheel_requirements())
    names = {normalize(d.metadata["Name"]) for d in md.distributions() if d.metadata["Name"]}
    return sorted(names - allowed - {"overworld"})


SITECUSTOMIZE = '''"""Written by bench/gpu/box.py for the dry run: this interpreter's site-packages replaced by a view of
it that holds only what the GPU box has and the wheel set brings; everything else is not found."""
import sys

_REAL = {real!r}
_BOX = {box!r}
_seen = set()
_path = []
for _p in sys.path:
    _p = _BOX if _p in _REAL else _p
    if _p not in _seen:
        _seen.add(_p)
        _path.append(_p)
sys.path[:] = _path
'''


def simulate(directory: Path) -> dict[str, str]:
    """Build, in `directory`, a site-packages of links to the box's and the wheel set's distributions (files
    and metadata) and a sitecustomize that puts it in place of the real one; returns the environment
    variables that do so for a process and all it starts (set before the interpreter starts)."""
    import site

    allowed = box_distributions() | set(wheel_requirements())
    view = directory / "site-packages"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for dist in md.distributions():
        if normalize(dist.metadata["Name"] or "") not in allowed:
            continue
        for top in sorted({Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}):
            source, link = Path(str(dist.locate_file(top))), view / top
            if source.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(source)
    real = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE.format(real=sorted(real), box=str(view)))
    (directory / "hidden.json").write_text(json.dumps(hidden_distributions(), indent=1))
    path = [str(directory), str(ROOT / "services"), str(ROOT)]
    return {"PYTHONPATH": os.pathsep.join(path + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def missing_wheel_modules() -> list[str]:
    """Wheel-set distributions this interpreter cannot find (on the box before install_wheels)."""
    missing = []
    for name in wheel_requirements():
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
    return missing


def install_wheels(wheel_dir: Path = WHEEL_DIR, site: Path = SITE) -> dict[str, str]:
    """On the box: install the wheel set into `site` (no index, no network) unless it is there already;
    returns the environment that puts it (and the checkout) first on the path."""
    wanted = wheel_requirements()
    stamp = site / ".installed.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == wanted):
        wheels = sorted(wheel_dir.glob("*.whl"))
        if not wheels:
            raise SystemExit(f"{wheel_dir} has no wheels: make them where pip reaches an index "
                             "(`make gpu-wheels`) and carry that folder with the checkout")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        stamp.write_text(json.dumps(wanted))
    path = [str(site), str(ROOT / "services"), str(ROOT)]
    return {"PYTHONPATH": os.pathsep.join(path + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
