"""The GPU box's Python packages (bench/gpu/box_packages.txt, from the device tool's KINDS.md) and the
view of this interpreter that the stand-in box (bench/gpu/box_standin.py) runs in.

`simulate` writes a sitecustomize module that swaps this interpreter's site-packages for a view holding
only the box's distributions installed here (and what they require): Ray, W&B, cffi and the rest are
then simply not found, in the stand-in's python3 and in every process it starts. What the check needs
beyond the box must then come from the carried wheels, as on the box.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import shutil
import site
from pathlib import Path

BOX_PACKAGES_TXT = Path(__file__).with_name("box_packages.txt")
WHEELS_TXT = Path(__file__).with_name("wheels.txt")
BOX_PYTHON = (3, 12)
# The project's runtime dependencies (pyproject.toml: the core, rollout-worker and trainer) that the check
# needs neither from the box nor from the carry: the Redis and S3 backends (it runs the embedded ones), Ray
# and W&B (num_workers: 0, no W&B logger) and ffmpeg (no episode videos).
LEFT_BEHIND = ("redis", "minio", "ray", "wandb", "imageio-ffmpeg")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(path: Path) -> dict[str, str | None]:
    """A list of `name` or `name==version` lines (comments left out): normalized name -> version."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalize(name)] = version.strip() or None
    return out


def box_packages() -> dict[str, str | None]:
    return pinned(BOX_PACKAGES_TXT)


def wheel_requirements() -> dict[str, str]:
    """wheels.txt: normalized name -> pinned version (every line is pinned)."""
    return {name: version or "" for name, version in pinned(WHEELS_TXT).items()}


def _requirements(dist: str) -> list[str]:
    """The distributions `dist` requires unconditionally (extras left out), by normalized name."""
    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
        return []
    return [normalize(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]) for req in reqs
            if "extra ==" not in req.replace('"', "'").replace("extra==", "extra ==")]


def box_distributions_here() -> set[str]:
    """The box's packages and everything they require, as installed here."""
    seen: set[str] = set()
    todo = list(box_packages())
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_requirements(name))
    return seen


SITECUSTOMIZE = '''"""Written by bench/gpu/box.py for the stand-in box: this interpreter's site-packages replaced by a
view of it that holds only what the GPU box has; everything else is not found."""
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


def simulate(directory: Path) -> Path:
    """Write, in `directory`, a site-packages of links to the box's distributions installed here and a
    sitecustomize that puts it in place of the real one; returns the folder to put first on PYTHONPATH.
    hidden.json lists what the view leaves out."""
    allowed = box_distributions_here()
    view = directory / "site-packages"
    shutil.rmtree(directory, ignore_errors=True)
    view.mkdir(parents=True)
    hidden = set()
    for dist in md.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if name not in allowed:
            hidden.add(name)
            continue
        for top in sorted({Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}):
            source, link = Path(str(dist.locate_file(top))), view / top
            if source.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(source)
    real = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE.format(real=sorted(real), box=str(view)))
    (directory / "hidden.json").write_text(json.dumps(sorted(hidden), indent=1))
    return directory
