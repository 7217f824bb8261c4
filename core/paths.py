"""Where kvchat keeps rebuildable caches and chat history (the models folder is models.registry's).

Environment variables override each location, which is how tests keep to temporary folders.
"""
import hashlib
import os
import shutil
import time
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


def kernels_fingerprint() -> str:
    """Hash of the numba kernels' sources (kernels/cpu/**/*.py, kernels/types.py) and numba's version.
    numba's own cache notices when the file of a compiled function changes, not when a helper it
    inlines from another module does (ops.ggml_expf inside the attention kernels): a new fingerprint
    is a fresh cache. (The choices compiled in from the environment, KVCHAT_ISA and KVCHAT_PREFETCH,
    each get a subfolder of it: kernels.cpu.isa.)"""
    from importlib import metadata

    h = hashlib.sha256()
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    for f in [kernels / "types.py", *sorted((kernels / "cpu").rglob("*.py"))]:   # types: constants they compile in
        h.update(str(f.relative_to(kernels)).encode() + b"\0" + f.read_bytes())
    try:
        h.update(metadata.version("numba").encode())
    except metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:16]


STALE_CACHE_S = 24 * 3600


def use_numba_cache() -> None:
    """Point numba's on-disk compile cache at the user cache dir, before numba is first imported,
    so the second start of the native engine does not recompile its kernels. One folder per
    kernels_fingerprint(); the folders of other versions go once unused for a day (another
    kvchat, older or newer, may still be running from them)."""
    # numba's locators after ours: by name, as numba.core.caching has them (core/numba_locator.py)
    os.environ.setdefault("NUMBA_CACHE_LOCATOR_CLASSES", "core.numba_locator.CheckoutCacheLocator, UserProvidedCacheLocator, "
                          "InTreeCacheLocator, UserWideCacheLocator, IPythonCacheLocator, ZipCacheLocator")
    if "NUMBA_CACHE_DIR" in os.environ:
        return
    base = cache_dir() / "numba"
    current = base / kernels_fingerprint()
    os.environ["NUMBA_CACHE_DIR"] = str(current)
    try:
        current.mkdir(parents=True, exist_ok=True)
        os.utime(current)
        for old in base.iterdir():
            if old.is_dir() and old != current and time.time() - old.stat().st_mtime > STALE_CACHE_S:
                shutil.rmtree(old, ignore_errors=True)
    except OSError:
        pass                                  # a cache we cannot tidy still works


# Version of the repacked-weights layout (models.transformer caches the Q4_K x8 repack): a new
# layout is a new folder, and the model's folders of other layouts are removed.
WEIGHTS_LAYOUT = "x8-1"


def weights_cache_dir(gguf_path: Path) -> Path:
    """Folder for one GGUF's repacked weights, keyed by its path, size, mtime and the layout. The
    folders of the same path's other versions are removed; another file of the same name (and
    size) elsewhere has its own, so two kvchats loading the two at once never remove each other's
    folder while writing it. Folders of the first naming scheme (name-size-mtime-layout) go too."""
    st = gguf_path.stat()
    base = cache_dir() / "weights"
    where = hashlib.sha256(str(gguf_path.resolve()).encode()).hexdigest()[:12]
    prefix = f"{gguf_path.stem}-p{where}-"
    legacy = f"{gguf_path.stem}-{st.st_size}-"
    current = base / f"{prefix}{st.st_size}-{st.st_mtime_ns}-{WEIGHTS_LAYOUT}"
    try:
        for old in base.iterdir() if base.is_dir() else ():
            if old.is_dir() and old != current and old.name.startswith((prefix, legacy)):
                shutil.rmtree(old, ignore_errors=True)
    except OSError:
        pass
    return current
