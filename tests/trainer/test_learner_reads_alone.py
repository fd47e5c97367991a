"""trainer/learner.py reads top to bottom on its own: every attribute PPOLearner reads is defined in the
file or declared at the top of the class (an annotation, or a method named in the comment under it),
not inherited unseen from the runtime. Methods are declared in a comment: `its methods: name(args):
what; name2: what; ...`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LEARNER = Path(__file__).resolve().parents[2] / "services" / "overworld" / "trainer" / "learner.py"


def undeclared(source: str, class_name: str = "PPOLearner") -> list[str]:
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    declared = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    declared |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    first = min(n.lineno for n in cls.body if isinstance(n, ast.FunctionDef))
    comments = " ".join(line.split("#", 1)[1].strip() for line in source.splitlines()[cls.lineno:first - 1]
                        if "#" in line)
    methods = comments.split("its methods:", 1)[1].split(" # ")[0] if "its methods:" in comments else ""
    declared |= {m[1] for item in methods.split(";") if (m := re.match(r"\s*([a-z_]+)", item))}
    reads = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (declared.add if isinstance(node.ctx, ast.Store) else reads.add)(node.attr)
    return sorted(reads - declared)


def test_every_attribute_the_learner_reads_is_defined_or_declared_in_its_file() -> None:
    assert undeclared(LEARNER.read_text()) == []


def test_the_check_finds_an_attribute_read_from_nowhere() -> None:
    source = LEARNER.read_text().replace("self.gae_client.estimate(", "self.gae.estimate(", 1)
    assert undeclared(source) == ["gae"]
    assert "gae_client" in undeclared(LEARNER.read_text().replace("    gae_client: GaeClient\n", "", 1))
