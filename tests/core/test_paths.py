"""The numba compile cache: one folder per version of the kernels, older folders tidied away."""
import os
import time

from core import paths


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
