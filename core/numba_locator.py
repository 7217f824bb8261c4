"""Where numba keeps a compiled function: by its source file's path within kvchat, not per checkout.

numba's own locator for NUMBA_CACHE_DIR (UserProvidedCacheLocator) names a source file's folder in
the cache by a hash of the file's absolute directory, so a second clone, a fresh CI checkout or an
install in another folder compiles every kernel again (minutes), though numba (0.68) already checks
each cached entry against a hash of its source file's content. This locator names the folder by the
file's path relative to kvchat's root instead: any checkout of the same sources finds its kernels
compiled, and an entry whose source file differs is still dropped by that content check.
core.paths.use_numba_cache selects it (NUMBA_CACHE_LOCATOR_CLASSES); numba imports this module when
it caches its first function. Files outside kvchat keep numba's own locators.
"""
from __future__ import annotations

import os
from pathlib import Path

from numba.core import config
from numba.core.caching import UserProvidedCacheLocator

ROOT = Path(__file__).resolve().parent.parent


class CheckoutCacheLocator(UserProvidedCacheLocator):
    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        rel = Path(py_file).resolve().parent.relative_to(ROOT)
        self._cache_path = os.path.join(config.CACHE_DIR, "kvchat", *rel.parts)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not Path(py_file).resolve().is_relative_to(ROOT):
            return None
        return super().from_function(py_func, py_file)
