"""The decode kernels' repacked weights are cached on disk and memory-mapped back on the next load."""
import numpy as np
import pytest

from kernels.cpu.matmul import TILE16_TYPES
from models.transformer import load_model


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q6_K"])
def test_cached_tiles_give_the_same_model(tiny_model, tmp_path, qtype):
    g, _ = tiny_model("qwen2", qtype)
    fresh = load_model(g, cache_dir=tmp_path / "w")
    files = sorted((tmp_path / "w").glob("*.tiles.npy"))
    tiled = [m for m in fresh._matrices() if m.ggml_type in TILE16_TYPES]
    assert len(files) == len(tiled) > 0                   # one file per tiled matrix, nothing else
    cached = load_model(g, cache_dir=tmp_path / "w")
    for a, b in zip(fresh._matrices(), cached._matrices()):
        if a.tiles is not None:
            assert isinstance(b.tiles.base, np.memmap) or not b.tiles.flags.owndata   # mapped, not rebuilt
            np.testing.assert_array_equal(np.asarray(a.tiles), np.asarray(b.tiles))
    x = np.random.default_rng(0).standard_normal(fresh.cfg.n_embd).astype(np.float32)
    w_fresh, w_cached = fresh.blocks[0].w_gate, cached.blocks[0].w_gate
    np.testing.assert_array_equal(w_fresh.gemv(x), w_cached.gemv(x))


def test_damaged_cache_entry_is_rebuilt(tiny_model, tmp_path):
    g, _ = tiny_model("qwen2", "Q5_0")
    load_model(g, cache_dir=tmp_path / "w")
    victim = sorted((tmp_path / "w").glob("*.tiles.npy"))[0]
    victim.write_bytes(b"not a numpy file")
    again = load_model(g, cache_dir=tmp_path / "w")
    assert victim.read_bytes()[:6] == b"\x93NUMPY"          # rewritten
    assert all(m.tiles is not None for m in again._matrices() if m.ggml_type in TILE16_TYPES)
