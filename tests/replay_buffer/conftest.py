"""Replay-buffer fixtures: every test that takes `buffer` runs once per backend
(memory index + local blobs, Redis index + S3 blobs), over real gRPC sockets."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # rb_support, for this directory's tests

from rb_support import (  # noqa: E402
    LENGTH,
    SERVICE_DEFAULTS,
    SPACES,
    Backend,
    Buffer,
    make_rb_config,
    new_run_id,
)


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    workdir = tmp_path_factory.mktemp("blobs")
    if request.param == "memory":
        return Backend("memory", workdir)
    redis_server = request.getfixturevalue("redis_server")
    s3 = request.getfixturevalue("s3_server")
    return Backend("redis", workdir, redis_server.url, dict(s3))


@pytest.fixture
def make_buffer(backend: Backend) -> Iterator[Callable[..., Buffer]]:
    made: list[Buffer] = []

    def make(fronts: int = 1, fragment_length: int = LENGTH, spaces: Any = SPACES, run_id: str | None = None,
             service: dict[str, Any] | None = None, **rb_kwargs: Any) -> Buffer:
        buffer = Buffer(backend, run_id or new_run_id(), make_rb_config(**rb_kwargs), fragment_length, spaces,
                        {**SERVICE_DEFAULTS, **(service or {})})
        made.append(buffer)
        for _ in range(fronts):
            buffer.add_front()
        return buffer

    yield make
    for buffer in made:
        buffer.close()
