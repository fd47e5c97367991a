"""Numba code compiled into an image at build time, used on a read-only root filesystem.

Numba keeps a jitted function's compiled code (``cache=True``: Crafter's world generation) next to
its source or in NUMBA_CACHE_DIR, but only in a directory it can write (it checks by creating a
file there). A pod's root filesystem is read-only, so the code compiled at build time would never be
found and every environment process would compile it again: seconds of CPU each.

``BakedCacheLocator`` (``NUMBA_CACHE_LOCATOR_CLASSES=overworld.envs.baked_numba_cache.BakedCacheLocator``)
is numba's user-wide cache ($HOME/.cache/numba, on the pod's writable /tmp) whose directory for a
source file starts as a copy of the one baked at build time (``OVERWORLD_NUMBA_BAKED_CACHE``, written
there with NUMBA_CACHE_DIR): numba loads the baked code and saves anything new where it may write.
Each file is copied beside its place and renamed in, data before index, so that environment
processes starting together never read half a copy or an index without its data.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from numba.core.caching import UserWideCacheLocator

BAKED_CACHE_ENV = "OVERWORLD_NUMBA_BAKED_CACHE"


def seed(baked: Path, cache: Path) -> list[str]:
    """Copy the files of `baked` that `cache` lacks into it; return their names."""
    if not baked.is_dir():
        return []
    missing = [f for f in baked.iterdir() if f.is_file() and not (cache / f.name).exists()]
    missing.sort(key=lambda f: f.suffix == ".nbi")  # an index only once the data it names is there
    for source in missing:
        partial = cache / f".{source.name}.{os.getpid()}.partial"
        shutil.copyfile(source, partial)
        os.replace(partial, cache / source.name)
    return [f.name for f in missing]


class BakedCacheLocator(UserWideCacheLocator):
    """Numba's user-wide cache locator, seeded from the image's baked cache."""

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> BakedCacheLocator | None:
        locator: BakedCacheLocator | None = super().from_function(py_func, py_file)
        baked = os.environ.get(BAKED_CACHE_ENV)
        if locator is not None and baked:
            seed(Path(baked) / cls.get_suitable_cache_subpath(py_file), Path(locator.get_cache_path()))
        return locator
