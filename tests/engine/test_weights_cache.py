"""The exact kernels' repacked weights (8-row layouts, fused q/k/v and gate/up) are cached on disk
and read back on the next load, into memory or as a mapping (KVCHAT_WEIGHTS)."""
import mmap
import os

import numpy as np
import pytest

from kernels.types import Q6_K
from models.architectures import load_model
from models.errors import BadInputError


def _exact(model):
    return [m for m in model._matrices() if m.exact is not None]


@pytest.mark.parametrize("where", ["memory", "mapped"])
@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q6_K"])
def test_cached_layouts_give_the_same_model(tiny_model, tmp_path, monkeypatch, qtype, where):
    """The second load reads every repacked layout from its file, never repacking again, into the
    process's memory or as a mapping of the file (KVCHAT_WEIGHTS), with the same bytes."""
    from models import transformer

    monkeypatch.setenv("KVCHAT_WEIGHTS", where)
    g, _ = tiny_model("qwen2", qtype)
    fresh = load_model(g, cache_dir=tmp_path / "w")
    files = sorted((tmp_path / "w").glob("*.x8.npy"))
    # a lone Q6_K matrix reads the GGUF rows in place; every other exact layout is a file
    repacked = [m for m in _exact(fresh) if m.ggml_type != Q6_K or m.raw is None]
    assert len(files) == len(repacked) > 0                         # one file per repacked matrix, nothing else
    # q, k, v and gate, up of one type run fused: one file (and one matrix) per group
    assert any("+" in f.name for f in files)
    built = []
    real = transformer.exact_layout
    monkeypatch.setattr(transformer, "exact_layout", lambda raw, t, *a: built.append(t) or real(raw, t, *a))
    cached = load_model(g, cache_dir=tmp_path / "w")
    # read, not rebuilt: the only layouts built are the lone matrices read in place
    assert len(built) == len([m for m in _exact(cached) if m.raw is not None and m.ggml_type not in transformer.REPACKED_TYPES])
    for a, b in zip(_exact(fresh), _exact(cached)):
        in_place = a.ggml_type == Q6_K and a.raw is not None
        assert _mapped(b.exact) == (where == "mapped"), (where, b.exact.base)
        if in_place:                      # the GGUF rows: a view of the file, or a copy
            assert np.shares_memory(b.exact, b.raw) == (where == "mapped")
        np.testing.assert_array_equal(np.asarray(a.exact), np.asarray(b.exact))


@pytest.mark.parametrize("where", ["memory", "mapped"])
def test_weights_in_memory_leave_the_file_unmapped(tmp_path, monkeypatch, where):
    """In memory, a matrix read in place is read from the file, and the mapping's pages never join
    the process's RSS (it holds the weights once); mapped, the kernels read the file's own pages."""
    from models.gguf_file import open_model
    from models.transformer import Weights

    monkeypatch.setenv("KVCHAT_WEIGHTS", where)
    path = _write_matrices(tmp_path / "m.gguf", [("a.weight", Q6_K, 1024, 1024)])
    g = open_model(path)
    m = Weights(g).matrix("a.weight")
    np.asarray(m.exact).sum(dtype=np.int64)                            # only to touch every byte
    size, held = _mapped_rss(path)
    assert size >= path.stat().st_size                                 # the mapping was found
    if where == "memory":
        assert held <= 128 << 10, held     # the header's pages (and the kernel's fault-around), not the 860 KB of weights
    else:
        assert held >= m.exact.nbytes, held


def test_a_resident_tensor_comes_from_the_file_that_was_mapped(tmp_path):
    """GGUFFile.resident reads the file it mapped: a file put in its place meanwhile is not read (the
    mapping's bytes are), and one cut short meanwhile is a one-line error."""
    from models.gguf_file import open_model

    def write(path, seed):
        _write_matrices(path, [("a.weight", Q6_K, 64, 1024)], seed)

    path, other = tmp_path / "m.gguf", tmp_path / "other.gguf"
    write(path, 0)
    g = open_model(path)
    want = np.array(g.reader.tensors[0].data)
    np.testing.assert_array_equal(g.resident("a.weight"), want)
    write(other, 1)
    assert other.read_bytes() != path.read_bytes()
    other.replace(path)                                    # another file under the same name
    np.testing.assert_array_equal(g.resident("a.weight"), want)
    path.unlink()                                          # no file under the name
    np.testing.assert_array_equal(g.resident("a.weight"), want)

    write(path, 2)
    g = open_model(path)
    t = g.tensors["a.weight"]
    with open(path, "r+b") as f:                           # the same file, cut inside the tensor
        f.truncate(t.offset + t.n_bytes // 2)
    with pytest.raises(BadInputError, match="truncated while it was being loaded"):
        g.resident("a.weight")


def _mapped(a: np.ndarray) -> bool:
    """Is the memory under `a` a file mapping (numpy's memmap or the GGUF reader's mmap)?"""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return isinstance(a.obj if isinstance(a, memoryview) else a, mmap.mmap)


def _mapped_rss(path) -> tuple[int, int]:
    """(size, resident bytes) of this process's mappings of `path` (/proc/self/smaps)."""
    size, rss, ours = 0, 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            ours = line.rstrip().endswith(str(path))
        elif ours and head[0] in ("Size:", "Rss:"):
            n = int(head[1]) << 10
            size, rss = (size + n, rss) if head[0] == "Size:" else (size, rss + n)
    return size, rss


def _write_matrices(path, matrices, seed: int = 0):
    """A GGUF holding only random quantized matrices [(name, ggml type, rows, cols)], at `path`."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from kernels.reference import random_quantized

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    for name, ggml_type, rows, cols in matrices:
        writer.add_tensor(name, random_quantized(ggml_type, rows, cols, rng), raw_dtype=GGMLQuantizationType(ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_weights_choice(tmp_path, monkeypatch):
    """auto reads the weights into memory where the kernel gives transparent huge pages and they take
    at most half of the available memory, and maps them elsewhere; KVCHAT_WEIGHTS forces either, and
    refuses anything else."""
    from models import gguf_file

    setting, meminfo = tmp_path / "enabled", tmp_path / "meminfo"
    monkeypatch.setattr(gguf_file, "THP_SETTING", setting)
    monkeypatch.setattr(gguf_file, "MEMINFO", meminfo)
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    monkeypatch.delenv("KVCHAT_WEIGHTS", raising=False)
    assert not gguf_file.weights_in_memory()                       # no such setting: no huge pages
    for text, expect in (("always [madvise] never", True), ("[always] madvise never", True), ("always madvise [never]", False)):
        setting.write_text(text + "\n")
        assert gguf_file.weights_in_memory(4_000_000 << 10) == expect
        assert not gguf_file.weights_in_memory(4_000_001 << 10)     # more than half of what is available
        monkeypatch.setenv("KVCHAT_WEIGHTS", "mapped")
        assert not gguf_file.weights_in_memory()
        monkeypatch.setenv("KVCHAT_WEIGHTS", "memory")
        assert gguf_file.weights_in_memory(10 ** 12)
        monkeypatch.delenv("KVCHAT_WEIGHTS")
    meminfo.unlink()
    assert not gguf_file.weights_in_memory()                       # nothing says what is available
    monkeypatch.setenv("KVCHAT_WEIGHTS", "hugepages")
    with pytest.raises(BadInputError, match="KVCHAT_WEIGHTS='hugepages' is not one of auto, memory, mapped"):
        gguf_file.weights_in_memory()


def test_damaged_cache_entry_is_rebuilt(tiny_model, tmp_path):
    g, _ = tiny_model("qwen2", "Q5_0")
    load_model(g, cache_dir=tmp_path / "w")
    victim = sorted((tmp_path / "w").glob("*.x8.npy"))[0]
    victim.write_bytes(b"not a numpy file")
    again = load_model(g, cache_dir=tmp_path / "w")
    assert victim.read_bytes()[:6] == b"\x93NUMPY"          # rewritten
    assert len(_exact(again)) > 0


def test_stale_layout_folders_are_removed(tmp_path, monkeypatch):
    """A new version of a file (or of the layout) replaces its folder, and so does a folder of the
    first naming scheme; other models' folders stay, and so does the folder of another file of the
    same name and size elsewhere: two kvchats loading the two at once once removed each other's
    folder while writing it (test_cpu_variants' parallel runs of the tiny models)."""
    from core import paths

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    twin = tmp_path / "elsewhere" / "m.gguf"
    twin.parent.mkdir()
    twin.write_bytes(b"y" * 10)
    os.utime(twin, ns=(1, 1))
    other = tmp_path / "weights" / "n-10-1-old"
    legacy = tmp_path / "weights" / "m-10-1-v1"
    for d in (other, legacy):
        d.mkdir(parents=True)
    twin_dir = paths.weights_cache_dir(twin)
    twin_dir.mkdir()
    current = paths.weights_cache_dir(gguf)
    assert current.name.endswith(paths.WEIGHTS_LAYOUT) and current != twin_dir
    assert not legacy.exists() and other.exists() and twin_dir.exists()
    current.mkdir()
    os.utime(gguf, ns=(2, 2))                                 # the file changed: its old folder goes
    assert paths.weights_cache_dir(gguf) != current and not current.exists() and twin_dir.exists()


def test_a_matrix_without_an_exact_layout_caches_nothing(tmp_path):
    """Q4_K with 12 rows: llama.cpp repacks only a multiple of 8 rows (and its other kernel is not
    reproduced), so kvchat's CPU engine refuses the file, naming the matrix, and caches nothing for
    it; the 16-row one beside it is repacked and cached."""
    from kernels.types import Q4_K
    from models.gguf_file import open_model
    from models.transformer import Weights

    a, b = "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"          # (names the engines read: others are refused)
    g = open_model(_write_matrices(tmp_path / "m.gguf", [(a, Q4_K, 12, 256), (b, Q4_K, 16, 256)]))
    w = Weights(g, cache_dir=tmp_path / "w")
    with pytest.raises(BadInputError, match=a):              # the engine says which, auto takes llama.cpp
        w.matrix(a)
    assert w.matrix(b).exact is not None
    assert [f.name for f in (tmp_path / "w").glob("*.x8.npy")] == [f"{b}.x8.npy"]
    assert g.unsupported() == f"Q4_K matrices of 12 rows ({a})" and g.unsupported(cpu=False) is None
