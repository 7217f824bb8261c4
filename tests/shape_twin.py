"""Shape twins of GGUF files: the same header (metadata, vocabulary, tensor names, types and shapes)
with random weights, for timing a model where its weights cannot go.

Why: the GPU machine that sometimes runs kvchat's GPU checks takes a working tree of at most 64 MiB
and reaches no network, so a registry model cannot travel there. Its header can (a few MB). Speed
does not depend on the weights' values, only on their types and shapes, so a twin filled with random
valid blocks (finite, small f16 scales) times the same kernels over the same bytes.

    python -m tests.shape_twin head MODEL_PATH OUT_DIR   # writes OUT_DIR/NAME.head (+ its size in NAME.size)
    python -m tests.shape_twin fill OUT_DIR/NAME.head TWIN.gguf
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

# byte range of each type's f16 scale fields within a block (they must hold finite, small values in
# a random block; tests/engine/conftest.py's random K-quant blocks use it too)
F16_FIELDS = {"Q4_0": (0, 2), "Q4_1": (0, 4), "Q5_0": (0, 2), "Q5_1": (0, 4), "Q8_0": (0, 2),
              "Q2_K": (80, 84), "Q3_K": (108, 110), "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210),
              "IQ4_NL": (0, 2), "IQ4_XS": (0, 2)}
# the scale drawn there: dequantized weights of std about 0.02-0.05, as a trained model's are
SCALES = {"Q4_0": 8e-3, "Q4_1": 8e-3, "Q5_0": 4e-3, "Q5_1": 4e-3, "Q8_0": 5e-4, "Q2_K": 4e-3, "Q3_K": 5e-4,
          "Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 3e-5, "IQ4_NL": 3e-4, "IQ4_XS": 3e-5}


def write_head(model: Path, out_dir: Path) -> Path:
    """Copies the bytes before the tensor data; NAME.size holds the whole file's length."""
    reader = gguf.GGUFReader(model)
    head = out_dir / (model.stem + ".head")
    with open(model, "rb") as f:
        head.write_bytes(f.read(reader.data_offset))
    head.with_suffix(".size").write_text(str(model.stat().st_size))
    return head


def fill(head: Path, twin: Path, seed: int = 0) -> Path:
    """Writes the header, sizes the file, then fills each tensor in place with random valid data."""
    rng = np.random.default_rng(seed)
    twin.write_bytes(head.read_bytes())
    with open(twin, "r+b") as f:
        f.truncate(int(head.with_suffix(".size").read_text()))
    reader = gguf.GGUFReader(twin, "r+")
    for t in reader.tensors:
        name, data = t.tensor_type.name, t.data
        if name == "F32":                                   # norms: about 1; other vectors small
            data[...] = (1.0 if t.name.endswith("norm.weight") else 0.0) + 0.02 * rng.standard_normal(data.shape)
        elif name in ("F16", "BF16"):
            values = (0.02 * rng.standard_normal(data.shape)).astype(np.float32)
            data[...] = values.astype(np.float16) if name == "F16" else (values.view(np.uint32) >> 16).astype(np.uint16)
        elif name in SCALES:
            (a, b), scale = F16_FIELDS[name], SCALES[name]
            size = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
            blocks = data.reshape(-1, size)                 # (n_blocks, bytes per block), a view of the file
            blocks[...] = rng.integers(0, 256, size=blocks.shape, dtype=np.uint8)
            f16 = rng.uniform(0.5 * scale, 1.5 * scale, size=(len(blocks), (b - a) // 2)).astype(np.float16)
            blocks[:, a:b] = f16.view(np.uint8)
        else:
            raise ValueError(f"shape_twin: no random fill for {name} ({t.name})")
    reader.data.flush()
    return twin


if __name__ == "__main__":
    verb, src, dst = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    print(write_head(src, dst) if verb == "head" else fill(src, dst))
