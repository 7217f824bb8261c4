"""Where kvchat keeps rebuildable caches and chat history (the models folder is models.registry's).

Environment variables override each location, which is how tests keep to temporary folders.
"""
import os
from pathlib import Path

import platformdirs

APP_NAME = "kvchat"


def cache_dir() -> Path:
    """Folder for compile caches and other rebuildable files (KVCHAT_CACHE_DIR overrides)."""
    path = Path(os.environ.get("KVCHAT_CACHE_DIR") or platformdirs.user_cache_dir(APP_NAME))
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """Folder for chat history and settings (KVCHAT_DATA_DIR overrides the user data dir)."""
    path = Path(os.environ.get("KVCHAT_DATA_DIR") or platformdirs.user_data_dir(APP_NAME))
    path.mkdir(parents=True, exist_ok=True)
    return path


def use_numba_cache() -> None:
    """Point numba's on-disk compile cache at the user cache dir, before numba is first imported,
    so the second start of the native engine does not recompile its kernels."""
    os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_dir() / "numba"))
