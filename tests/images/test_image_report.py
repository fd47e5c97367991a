"""The images' sizes and build times are recorded (bench/results/images.json, by docker/image_report.py)
for every image in both torch variants, and README.md's table of images is what the record says."""

from __future__ import annotations

import json
import sys

from rehearsal.oci_images import REPO, ROLES

sys.path.insert(0, str(REPO / "docker"))
from image_report import RESULT, block  # noqa: E402


def test_every_image_has_its_size_and_ci_its_build_times() -> None:
    result = json.loads(RESULT.read_text())
    for variant in ("cuda", "cpu"):
        sizes = result["sizes_bytes"][variant]
        assert all(isinstance(sizes.get(role), int) and sizes[role] > 0 for role in ROLES), (variant, sizes)
    assert result["sizes_bytes"]["cpu"]["rollout-worker"] < result["sizes_bytes"]["cuda"]["rollout-worker"]
    builds = result["build_seconds"]
    assert builds["from_nothing"] > builds["code_changed"] > 0 and builds["cached"] > 0, builds


def test_the_readme_table_is_the_record() -> None:
    readme = (REPO / "README.md").read_text()
    assert block(json.loads(RESULT.read_text())) in readme, "README.md's images differ: python docker/image_report.py --readme"
