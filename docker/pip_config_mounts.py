"""This machine's pip configuration, handed to an image build (buildah's `-v`) so that pip inside the
build reaches the same indexes, wheel directories, CA bundle and constraints as pip here.

A machine whose pip is configured (`pip config list`: a mirror, a local wheel directory, a proxy's CA)
often cannot reach PyPI without that configuration; an image build starts from the base image's pip,
which knows none of it. This writes the merged configuration (files and PIP_* variables) to
OUT/pip.conf and prints the `-v SOURCE:TARGET:ro` flags that mount it at /etc/pip.conf and every
local file or directory it names at the same path. Nothing is printed where pip has no
configuration; the mounts are not part of any layer.

    python3 docker/pip_config_mounts.py OUT_DIR
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

PATH_OPTIONS = ("cert", "client-cert", "constraint", "find-links", "index-url", "extra-index-url")


def configured() -> dict[str, str]:
    """`pip config list` as option -> value, the environment's PIP_* over the files'."""
    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    files: dict[str, str] = {}
    environment: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, option = key.rpartition(".")
        if not option or not value:
            continue
        if section in ("global", "install", "download"):
            files[option] = ast.literal_eval(value)
        elif section == ":env:":
            environment[option] = ast.literal_eval(value)
    return {**files, **environment}


def local_paths(option: str, value: str) -> list[Path]:
    """The files and directories of this machine an option's value names."""
    paths = []
    for item in value.split():
        url = urlparse(item)
        if url.scheme == "file":
            item = url.path
        elif url.scheme:
            continue
        if option in PATH_OPTIONS and Path(item).exists():
            path = Path(item).resolve()
            # an index's pages link to its files by relative paths (../../files/...): mount beside it too
            paths.append(path.parent if option.endswith("index-url") else path)
    return paths


def wheel_found_locally(pattern: str) -> bool:
    """Whether a wheel directory pip is configured with here holds a wheel matching `pattern`."""
    links = configured().get("find-links", "")
    return any(Path(d).is_dir() and any(Path(d).glob(pattern)) for d in links.split())


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    options = configured()
    if not options:
        return 0
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    conf = out / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(options.items())))
    mounts = {conf.resolve(): Path("/etc/pip.conf")}
    for option, value in options.items():
        mounts.update({path: path for path in local_paths(option, value)})
    print(" ".join(f"-v {source}:{target}:ro" for source, target in mounts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
