"""`make gpu-wheels`: gpu-wheels/, the one folder the GPU call carries (docs/gpu_check.md).

    python -m bench.gpu.carry [--out gpu-wheels] [--python-version 3.12]

Downloads the wheels of bench/gpu/wheels.txt for CPython 3.12 on manylinux x86_64 (the box's Python,
KINDS.md); crafter, published only as a source archive, is built here into a pure Python wheel. Refuses a
set in which a wheel would not install on the box, or that with the rest of what travels (the tracked
and untracked-not-ignored files, shared/) is over the device tool's 64 MiB.
--python-version builds the same list for another CPython: the stand-in box here runs 3.11.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import parse_wheel_filename

from bench.gpu.box import BOX_PYTHON, wheel_requirements

ROOT = Path(__file__).resolve().parents[2]
CARRY_DIR = "gpu-wheels"
CARRY_LIMIT = 64 * 2**20  # what travels with a device call: the working tree and the carried paths
# The box's glibc is not stated; its torch 2.11 wheels are manylinux_2_28, so it has at least that.
BOX_GLIBC_MINOR = 28
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(BOX_GLIBC_MINOR, 16, -1)] + ["manylinux2014_x86_64",
                                                                                  "manylinux1_x86_64"]


def box_tags(python: tuple[int, int] = BOX_PYTHON) -> set[Tag]:
    """Every wheel tag CPython `python` on the box's platform installs."""
    return {*cpython_tags(python, platforms=PLATFORMS), *compatible_tags(python, "cp" + "".join(map(str, python)),
                                                                         platforms=PLATFORMS)}


def fits(wheel: str, python: tuple[int, int] = BOX_PYTHON) -> bool:
    """Whether the wheel file `wheel` installs on CPython `python` on the box's platform."""
    _, _, _, tags = parse_wheel_filename(wheel)
    return bool(set(tags) & box_tags(python))


def portable(wheel: str) -> bool:
    """Pure Python or the stable ABI: the same file on any CPython 3 of the platform."""
    _, _, _, tags = parse_wheel_filename(wheel)
    return all(t.abi in ("none", "abi3") for t in tags)


def box_python_here(python: tuple[int, int] = BOX_PYTHON) -> str | None:
    """A CPython of the box's version on this machine (on the PATH, or pyenv's), None where there is none:
    Debian bookworm packages no 3.12 and PyPI no CPython."""
    name = f"python{python[0]}.{python[1]}"
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(name), *sorted(map(str, pyenv.glob(f"{python[0]}.{python[1]}.*/bin/{name}"))),
                  f"/usr/bin/{name}", f"/usr/local/bin/{name}"]
    for candidate in filter(None, candidates):
        try:
            done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                  text=True, timeout=30, check=False)
        except OSError:
            continue
        if done.returncode == 0 and done.stdout.strip() == str(python):
            return candidate
    return None


def travelling_files(checkout: Path) -> list[Path]:
    """What the device tool copies of the checkout besides the carried paths: tracked files and untracked
    ones git does not ignore (shared/ where the checkout has one is among them unless ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=checkout,
                            capture_output=True, text=True, check=True).stdout
    paths = [checkout / p for p in sorted(set(listed.split("\0"))) if p]
    shared = checkout / "shared"
    if shared.is_dir():
        paths += [p for p in shared.rglob("*") if p.is_file() and p not in paths]
    return [p for p in paths if p.is_file() and not p.is_symlink()]


def travelling_bytes(checkout: Path, carry: list[Path]) -> int:
    carried = [f for c in carry for f in ([c] if c.is_file() else c.rglob("*")) if f.is_file()]
    return sum(f.stat().st_size for f in [*travelling_files(checkout), *carried])


def download(requirement: str, out: Path, python: tuple[int, int]) -> None:
    version = ".".join(map(str, python))
    abi = "cp" + "".join(map(str, python))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", version,
         "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
         *[x for p in [*PLATFORMS, "any"] for x in ("--platform", p)], "-d", str(out), requirement],
        capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return
    print(f"{requirement}: no wheel for CPython {version} published; building one from its source archive")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, requirement], check=True)
        for wheel in Path(tmp).glob("*.whl"):
            if not portable(wheel.name) or not fits(wheel.name, python):
                raise SystemExit(f"{wheel.name} is not pure Python: it would not run on the box")
            wheel.rename(out / wheel.name)


def build(out: Path, python: tuple[int, int] = BOX_PYTHON, checkout: Path = ROOT, limit: int = CARRY_LIMIT) -> list[Path]:
    """gpu-wheels/ at `out` for CPython `python`; refused (SystemExit) when a wheel would not install there
    or what travels would be over `limit` bytes."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    requirements = wheel_requirements()
    for name, version in requirements.items():
        download(f"{name}=={version}", out, python)
    wheels = sorted(out.glob("*.whl"))
    got = {parse_wheel_filename(w.name)[0] for w in wheels}
    if got != set(requirements) or len(wheels) != len(requirements):
        raise SystemExit(f"{len(wheels)} wheels for {len(requirements)} requirements: {sorted(got ^ set(requirements))}")
    misfits = [w.name for w in wheels if not fits(w.name, python)]
    if misfits:
        raise SystemExit(f"not installable on CPython {python[0]}.{python[1]} manylinux x86_64: {misfits}")
    size, total = sum(w.stat().st_size for w in wheels), travelling_bytes(checkout, [out])
    print(f"{out}: {len(wheels)} wheels, {size / 2**20:.1f} MiB; with the rest of what travels "
          f"{total / 2**20:.1f} MiB of the device tool's {limit / 2**20:.0f} MiB")
    if total > limit:
        raise SystemExit("over what a device call carries: drop something from bench/gpu/wheels.txt")
    return wheels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / CARRY_DIR)
    p.add_argument("--python-version", default=".".join(map(str, BOX_PYTHON)))
    args = p.parse_args(argv)
    major, minor = (int(x) for x in args.python_version.split("."))
    build(args.out, (major, minor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
