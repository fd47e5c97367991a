from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.rollout_worker.conftest import Cluster


@pytest.fixture
def make_cluster_from_file(tmp_path: Path) -> Iterator[Callable[[Path], Cluster]]:
    made: list[Cluster] = []

    def make(path: Path) -> Cluster:
        made.append(Cluster(tmp_path, {}, source=path))
        return made[-1]

    yield make
    for c in made:
        c.stop()
