"""The pinned requirements of one role of pyproject.toml (`dependencies` plus the role's extra,
self-references such as `overworld[services]` followed) and what builds the package
(`build-system.requires`), one per line.

The images install these in a layer of their own before the package's code is copied in, so that a
change of code rebuilds only the small layer that holds the package, without reaching an index.

    python role_requirements.py pyproject.toml services > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, *roles: str) -> list[str]:
    document = tomllib.loads(pyproject.read_text())
    project = document["project"]
    extras = project["optional-dependencies"]
    found = [*document["build-system"]["requires"], *project["dependencies"]]
    todo, seen = list(roles), set()
    while todo:
        role = todo.pop()
        if role in seen:
            continue
        if role not in extras:
            raise SystemExit(f"pyproject.toml has no extra {role!r} (roles: {', '.join(extras)})")
        seen.add(role)
        for requirement in extras[role]:
            own = re.fullmatch(r"overworld\[([^\]]+)\]", requirement)
            if own:
                todo.extend(own[1].split(","))
            elif requirement not in found:
                found.append(requirement)
    return found


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(requirements(Path(argv[0]), *argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
