"""What the exact kernels' type families share: how the per-block scale arrays are padded, how far
ahead and in what chunks the kernels read, and from how many rows llama.cpp tiles
(types.TILED_MIN_ROWS, llama.cpp's ggml_tiled_min_batch, re-exported for the type families)."""

from kernels.types import TILED_MIN_ROWS  # noqa: F401

NB_PAD = 8                        # the per-block scale arrays are padded to a multiple of this
PREFETCH = 4096                   # decode reads each weight once per token: fetch this far ahead
# Activation rows per pass over W: the chunk (rows x K int8) stays in L2 while every weight group
# reads it; without it a prompt re-streams all its rows from L3 for each 8-row group.
X_CHUNK_BYTES = 192 << 10
