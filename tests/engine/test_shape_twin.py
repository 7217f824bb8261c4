"""tests/shape_twin.py: a twin keeps its model's header byte for byte and holds valid random weights,
so the GPU machine (no room for a registry model) times the same kernels over the same bytes."""
from __future__ import annotations

import gguf
import numpy as np

from core.native_backend import NativeBackend
from core.tokenizer import Tokenizer
from models.gguf_file import open_model
from tests.engine.conftest import write_tiny_model
from tests.shape_twin import fill, write_head


def test_twin_has_the_header_types_and_shapes_and_runs(tmp_path):
    src = write_tiny_model(tmp_path / "m.gguf", "qwen2", "Q4_K")
    head = write_head(src, tmp_path)
    twin = fill(head, tmp_path / "twin.gguf")
    offset = gguf.GGUFReader(src).data_offset
    assert twin.stat().st_size == src.stat().st_size
    assert twin.read_bytes()[:offset] == src.read_bytes()[:offset] == head.read_bytes()
    a, b = open_model(src), open_model(twin)
    assert {n: (t.ggml_type, t.shape) for n, t in a.tensors.items()} == {n: (t.ggml_type, t.shape) for n, t in b.tensors.items()}
    assert twin.read_bytes()[offset:] != src.read_bytes()[offset:]                 # new weights
    logits = NativeBackend(b, Tokenizer.from_gguf(b), 64).logits_all([1, 5, 9, 30])
    assert np.isfinite(logits).all() and logits.std() > 0
