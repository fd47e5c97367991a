"""The shape of services/overworld/ as docs/architecture.md draws it: packages that import downwards
only (no circle between two packages, counting imports inside functions too), MineStudio's facade
(`overworld.online`) and the launcher at the top where nothing else imports them, and modules small
enough to hold in one's head."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "services" / "overworld"
MAX_LINES = 450
TOP = {"online", "launch", "cli"}  # entry points: they may import anything, nothing imports them
ENTRY = {"cli", "launch", "__main__"}  # modules that start things (may import the facade)


def modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "v1" not in p.relative_to(PACKAGE).parts]


def unit(path: Path) -> str:
    """The package a module belongs to (`trainer`, `core`, ...), or the module's own name at the top. A
    package's `__main__` (`python -m overworld.X`) is an entry point above everything, not part of X."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return f"{parts[0]}.__main__" if parts[-1] == "__main__" else parts[0]


def imported_units(path: Path) -> set[str]:
    """The overworld packages (or top-level modules) `path` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "overworld" and len(parts) > 1 and parts[1] != "v1":
                out.add(parts[1])
    return out


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in modules():
        src = unit(path)
        edges.setdefault(src, set()).update(u for u in imported_units(path) if u != src)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt == path[0]:
                found.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each circle once, from its smallest member
                visit(nxt, [*path, nxt])

    for start in sorted(edges):
        visit(start, [start])
    return found


def test_no_module_outside_the_entry_points_imports_the_minestudio_facade_or_the_launcher() -> None:
    offenders = sorted(f"{p.relative_to(PACKAGE)} imports overworld.{u}" for p in modules()
                       if unit(p) not in TOP | {"__main__"} and p.stem not in ENTRY
                       for u in imported_units(p) & TOP)
    assert not offenders, offenders


def test_no_import_circle_between_packages() -> None:
    assert cycles(graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_module_is_too_long_to_hold_in_ones_head() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"
