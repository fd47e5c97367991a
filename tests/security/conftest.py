from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.services_in_one_process import Fleet, start_fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from start_fleet(Path(tmp_path_factory.mktemp("fleet")))


@pytest.fixture(autouse=True)
def _process_identity() -> Iterator[None]:
    """Tests pick identities with tls.use(); none leaks into the next test."""
    from overworld.core.security import tls

    yield
    tls.reset()
