"""The shape of services/overworld/ as docs/architecture.md draws it: packages on floors, each importing
only from floors below it (so no circle between packages), no circle between the modules of a package
either (imports inside functions and under TYPE_CHECKING count too: a helper that needs its owner
declares what it uses as a Protocol), MineStudio's facade (`overworld.online`) and `overworld run` at
the top where nothing else imports them, and modules small enough to hold in one's head. The cluster
harness (rehearsal/) is held to the last two as well."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "services" / "overworld"
REHEARSAL = Path(__file__).resolve().parents[1] / "rehearsal"  # the cluster harness: its modules too
MAX_LINES = 450
TOP = {"online", "launch", "cli"}  # entry points: they may import anything, nothing imports them
ENTRY = {"cli", "launch", "__main__"}  # modules that start things (may import the facade)
# Each package's floor (docs/architecture.md, "Packages"): an import goes to a lower floor only.
FLOORS = {
    "core": 0,
    "envs": 1,
    "policies": 2,
    "gae": 3, "model_registry": 3, "replay_buffer": 3, "rollout_manager": 3,  # services that use no other
    "rollout_worker": 4, "trainer": 4,  # services that use the others' clients
    "run_controller": 5,
    "serve": 6, "launch": 6,  # each service assembled from its flags; `overworld run`
    "cli": 7, "online": 7,  # the command line; MineStudio's facade
}


def modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "v1" not in p.relative_to(PACKAGE).parts]


def unit(path: Path) -> str:
    """The package a module belongs to (`trainer`, `core`, ...), or the module's own name at the top. A
    package's `__main__` (`python -m overworld.X`) is an entry point above everything, not part of X."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return f"{parts[0]}.__main__" if parts[-1] == "__main__" else parts[0]


def imports_in(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every absolute import in `path`, anywhere in it (`import m`:
    (m, []))."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
    return found


def imported_units(path: Path) -> set[str]:
    """The overworld packages (or top-level modules) `path` imports, anywhere in it."""
    out = set()
    for module, imported in imports_in(path):
        for name in [module, *(f"{module}.{n}" for n in imported)]:
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


def upward_arrows(edges: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """Each import that does not go down a floor; a package without a floor is one too. A package's
    `__main__` stands above every floor."""
    def floor(unit: str) -> int:
        return max(floors.values()) + 1 if unit.endswith("__main__") else floors.get(unit, -1)

    return sorted(f"{src} (floor {floor(src)}) imports {dst} (floor {floor(dst)})" for src, targets in edges.items()
                  for dst in targets if src != "__init__" and not floor(dst) < floor(src))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """Module to module imports inside each package. `from overworld.X import Y` names the module X.Y
    when there is one (it does not use X's __init__)."""
    names = {module_name(p) for p in modules()}
    edges: dict[str, set[str]] = {}
    for path in modules():
        src = module_name(path)
        out: set[str] = set()
        for module, imported in imports_in(path):
            targets = [f"{module}.{n}" if f"{module}.{n}"[10:] in names else module for n in imported] or [module]
            out.update(t[10:] for t in targets if t.startswith("overworld.") and t[10:] in names)
        edges[src] = {t for t in out if t != src and t.split(".")[0] == src.split(".")[0]}
    return edges


def test_every_import_goes_down_a_floor() -> None:
    assert upward_arrows(graph(), FLOORS) == []


def test_the_floor_check_finds_an_upward_import_and_a_package_without_a_floor() -> None:
    assert upward_arrows({"core": {"envs"}, "envs": {"core"}, "new": {"core"}, "x.__main__": {"new"}},
                         {"core": 0, "envs": 1}) == ["core (floor 0) imports envs (floor 1)",
                                                     "new (floor -1) imports core (floor 0)"]


def test_no_import_circle_between_the_modules_of_a_package() -> None:
    assert cycles(module_graph()) == []


def test_no_module_outside_the_entry_points_imports_the_minestudio_facade_or_the_launcher() -> None:
    offenders = sorted(f"{p.relative_to(PACKAGE)} imports overworld.{u}" for p in modules()
                       if unit(p) not in TOP | {"__main__"} and p.stem not in ENTRY
                       for u in imported_units(p) & TOP)
    assert not offenders, offenders


def test_no_import_circle_between_packages() -> None:
    assert cycles(graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def rehearsal_graph() -> dict[str, set[str]]:
    """Module to module imports inside rehearsal/ (inside functions and under TYPE_CHECKING too)."""
    names = {p.stem for p in REHEARSAL.glob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in sorted(REHEARSAL.glob("*.py")):
        targets = [t for module, imported in imports_in(path) for t in [module, *(f"{module}.{n}" for n in imported)]]
        out = {t.split(".")[1] for t in targets if t.startswith("rehearsal.") and t.split(".")[1] in names}
        edges[path.stem] = out - {path.stem}
    return edges


def test_no_import_circle_between_the_modules_of_the_rehearsal() -> None:
    assert cycles(rehearsal_graph()) == []


def test_no_module_is_too_long_to_hold_in_ones_head() -> None:
    paths = [*modules(), *sorted(REHEARSAL.glob("*.py"))]
    long = {str(p.relative_to(PACKAGE.parents[1])): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"
