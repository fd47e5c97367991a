from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.services_in_one_process import Fleet, start_fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fleet process (every service, mutual TLS) per fuzz module: its RSS is measured. Not one per
    session: its rollout worker steps on a core of its own until the fleet stops, and with session
    scope it did so through every test after the fuzzing."""
    yield from start_fleet(Path(tmp_path_factory.mktemp("fuzz-fleet")))
