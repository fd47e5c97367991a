from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.fleet import Fleet, start_fleet


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fleet process (every service, mutual TLS) for all the fuzzing: its RSS is measured."""
    yield from start_fleet(Path(tmp_path_factory.mktemp("fuzz-fleet")))
