"""The numba compile cache: one folder per version of the kernels, older folders tidied away, and
one place per kernel file for every checkout of the same sources."""
import os
import shutil
import subprocess
import sys
import time

from core import paths
from tests.conftest import ROOT


def test_numba_cache_is_per_kernels_version(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    base = tmp_path / "numba"
    stale, recent = base / "0123456789abcdef", base / "cpu_fedcba9876543210"
    for d in (stale, recent):
        d.mkdir(parents=True)
        (d / "f.nbi").write_bytes(b"x")
    old = time.time() - paths.STALE_CACHE_S - 60
    os.utime(stale, (old, old))
    paths.use_numba_cache()
    fingerprint = paths.kernels_fingerprint()
    assert os.environ["NUMBA_CACHE_DIR"] == str(base / fingerprint)
    assert (base / fingerprint).is_dir() and len(fingerprint) == 16
    assert not stale.exists()           # unused for more than a day: another version's, removed
    assert recent.exists()              # maybe in use by a kvchat still running: kept
    assert paths.kernels_fingerprint() == fingerprint


def test_fingerprint_follows_the_kernel_sources(tmp_path, monkeypatch):
    """A changed helper in any kernel file (not only the compiled function's own, and in subpackages
    too) changes it, and so does the type table, whose constants the kernels compile in."""
    src = tmp_path / "kernels" / "cpu"
    src.mkdir(parents=True)
    (src / "ops.py").write_text("def f(): return 1\n")
    (tmp_path / "kernels" / "types.py").write_text("Q8_0 = 8\n")
    fake = tmp_path / "core" / "paths.py"
    fake.parent.mkdir()
    monkeypatch.setattr(paths, "__file__", str(fake))
    first = paths.kernels_fingerprint()
    (src / "ops.py").write_text("def f(): return 2\n")
    second = paths.kernels_fingerprint()
    assert second != first
    (tmp_path / "kernels" / "types.py").write_text("Q8_0 = 9\n")
    third = paths.kernels_fingerprint()
    assert third != second
    (src / "qdot").mkdir()                                  # a kernel subpackage (kernels/cpu/qdot/)
    (src / "qdot" / "q0.py").write_text("def g(): return 1\n")
    assert paths.kernels_fingerprint() != third


CACHED_CALL = """
import numpy as np
from kernels.cpu import ops
ops.rms_norm(np.ones((4, 64), np.float32), np.ones(64, np.float32), 1e-6)
stats = ops._rms_norm_serial.stats
print(ops.__file__, sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
"""


def test_another_checkout_of_the_same_kernels_finds_them_compiled(tmp_path):
    """core/numba_locator.py: a second clone (a fresh CI checkout, an install elsewhere) loads the
    kernels the first compiled instead of compiling them again; numba's own locator would not."""
    clone = tmp_path / "clone"
    for pkg in ("kernels", "core"):
        shutil.copytree(ROOT / pkg, clone / pkg, ignore=shutil.ignore_patterns("__pycache__"))

    def run(where, **env):
        proc = subprocess.run([sys.executable, "-c", CACHED_CALL], cwd=where, capture_output=True, text=True,
                              env=os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "cache")} | env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        file, hits, misses = proc.stdout.split()
        assert file.startswith(str(where)), file          # the checkout's own sources ran
        return int(hits), int(misses)

    assert "core.numba_locator.CheckoutCacheLocator" in os.environ["NUMBA_CACHE_LOCATOR_CLASSES"]
    assert run(ROOT) in ((0, 1), (1, 0))                 # compiled and saved (or saved by a run before)
    assert run(clone) == (1, 0)
    assert run(clone, NUMBA_CACHE_LOCATOR_CLASSES="") == (0, 1)   # numba's locator: a folder per checkout


IMPORT_CORE = """
import core.engine
from numba.core import config
print(config.CACHE_DIR)
"""


def test_importing_core_points_numba_at_the_user_cache(tmp_path):
    """A script or library that imports core.engine (not the CLI) compiles into the same cache, not
    numba's default beside the sources, whose callers keep an edited callee's old kernels."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES")}
    proc = subprocess.run([sys.executable, "-c", IMPORT_CORE], cwd=ROOT, capture_output=True, text=True,
                          env=env | {"KVCHAT_CACHE_DIR": str(tmp_path)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(tmp_path / "numba" / paths.kernels_fingerprint()), proc.stdout
