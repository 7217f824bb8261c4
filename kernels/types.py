"""One record per GGML type, in the manner of ggml-cpu's `type_traits`, for the CPU and CUDA kernels
alike. GGML type ids appear here and nowhere else: every other module names a type (types.Q6_K) or
reads its record (TRAITS[t]). Plain data: importing it compiles nothing.

A record says what a block is (elements, bytes), what llama.cpp quantizes the activations to before
its integer dot product with that type (`vec_dot`: q8_0 or q8_K, the one encoding of it), and how
the exact kernels (kernels.cpu.qdot) lay the weights out: 8 rows interleaved per group, or the GGUF
rows as they are. Types without `vec_dot` have no exact kernel, and the CPU engine does not run them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as _G

# ids, named once (numba kernels compare against these as compile-time constants)
F32, F16, BF16 = int(_G.F32), int(_G.F16), int(_G.BF16)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 = int(_G.Q4_0), int(_G.Q4_1), int(_G.Q5_0), int(_G.Q5_1), int(_G.Q8_0), int(_G.Q8_1)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = int(_G.Q2_K), int(_G.Q3_K), int(_G.Q4_K), int(_G.Q5_K), int(_G.Q6_K), int(_G.Q8_K)
IQ4_NL, IQ4_XS = int(_G.IQ4_NL), int(_G.IQ4_XS)

# IQ4_NL's (and IQ4_XS's) 16 non-linear levels: a 4-bit index selects one, times the block's scale
# (ggml-common.h kvalues_iq4nl)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

# the activation types of llama.cpp's dot products (q8_0 stands for q8_1 too: the same values, with one
# more field that kernels.cpu.qdot computes for every q8_0 row); the float weights' are float rows
# rounded to the weight's type
ACT_Q8_0, ACT_Q8_K, ACT_F32, ACT_F16, ACT_BF16 = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class TypeTraits:
    id: int
    name: str
    block: int                   # elements per block
    size: int                    # bytes per block
    vec_dot: int | None = None   # ACT_*: the activation of llama.cpp's exact path; None: the float kernels
    x8: bool = False             # exact layout: groups of 8 interleaved rows (a repack, cached on disk);
                                 # False with vec_dot: the GGUF rows themselves
    rows8: bool = False          # exact only for a multiple of 8 rows: llama.cpp repacks such a matrix
                                 # (ggml-cpu/repack.cpp) and takes a kernel not reproduced here for others
    supported: bool = False      # the native engine loads it
    tiled: bool = False          # ggml-cpu's tiled kernel (ggml-cpu/tiled) takes its batches of 8 rows or more,
                                 # in mul_mat and in mul_mat_id's per-expert batches; the types llama.cpp
                                 # repacks or that tiled does not know take a gemv or vec_dot per row there

    @property
    def exact(self) -> bool:
        return self.vec_dot is not None

    def layout_rows(self, layout: np.ndarray) -> int:
        """Weight rows an exact layout holds (x8: with the padding of the last group)."""
        return layout.shape[0] * 8 if self.x8 else layout.shape[0]

    def layout_prefix(self, layout: np.ndarray, n_rows: int) -> np.ndarray:
        """The part of an exact layout that holds the first n_rows weight rows."""
        return layout[:-(-n_rows // 8)] if self.x8 else layout[:n_rows]


# (activation type, x8 layout, exact only for a multiple of 8 rows)
_EXACT = {Q5_0: (ACT_Q8_0, True, False), Q8_0: (ACT_Q8_0, True, False), Q4_0: (ACT_Q8_0, True, True),
          IQ4_NL: (ACT_Q8_0, True, True), Q4_1: (ACT_Q8_0, True, False), Q5_1: (ACT_Q8_0, True, False),
          Q4_K: (ACT_Q8_K, True, True), Q5_K: (ACT_Q8_K, False, False), Q6_K: (ACT_Q8_K, False, False),
          F32: (ACT_F32, False, False), F16: (ACT_F16, False, False), BF16: (ACT_BF16, False, False),
          Q3_K: (ACT_Q8_K, False, False), Q2_K: (ACT_Q8_K, False, False), IQ4_XS: (ACT_Q8_K, False, False)}
_TILED = {Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS}          # (Q4_K too where not repacked, which we do not run)
_SUPPORTED = {F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS}

TRAITS: dict[int, TypeTraits] = {
    int(t): TypeTraits(int(t), t.name, int(block), int(size), *_EXACT.get(int(t), (None, False, False)),
                       supported=int(t) in _SUPPORTED, tiled=int(t) in _TILED)
    for t, (block, size) in GGML_QUANT_SIZES.items()
}

SUPPORTED = frozenset(t for t, traits in TRAITS.items() if traits.supported)   # what the native engine loads

# For numba kernels: the activation type of each type id (-1: none). A global array is a constant there.
ACT_KIND = np.full(max(TRAITS) + 1, -1, np.int64)
for _t in TRAITS.values():
    if _t.vec_dot is not None:
        ACT_KIND[_t.id] = _t.vec_dot
TILED = np.array([TRAITS[i].tiled if i in TRAITS else False for i in range(max(TRAITS) + 1)], np.bool_)
X8 = np.array([TRAITS[i].x8 if i in TRAITS else False for i in range(max(TRAITS) + 1)], np.bool_)


def type_name(ggml_type: int) -> str:
    t = TRAITS.get(ggml_type)
    return t.name if t else f"type {ggml_type}"


# --- llama.cpp's batches ------------------------------------------------------------------------
# Its arithmetic for a row depends on how many rows the batch holding it has (ggml-cpu's mul_mat):
# the tiled types (TypeTraits.tiled) take their tiled kernel in a batch of TILED_MIN_ROWS rows or
# more and their vec_dot below; repacked Q4_K takes a batch's rows GEMM_ROWS at a time through its
# gemm and its last n % GEMM_ROWS rows through its gemv. The other types' kernels give every batch
# size the same numbers.
LLAMA_BATCH = 512        # llama.cpp's default n_batch and n_ubatch (llama-cpp-python's eval: logits_all)
TILED_MIN_ROWS = 8
GEMM_ROWS = 4


def prompt_pieces(n: int, most: int) -> list[int]:
    """n prompt rows as pieces of at most `most` rows (fed one after another) in which every row gets
    the arithmetic llama.cpp gives it in its batches of LLAMA_BATCH rows: a batch longer than `most`
    is cut at multiples of GEMM_ROWS, with at least TILED_MIN_ROWS rows in its last piece. (Cut at
    256 a batch of 260 would leave 4 rows on the K-quants' vec_dot, which llama.cpp tiles.)"""
    if most < 2 * TILED_MIN_ROWS or most % GEMM_ROWS:
        raise ValueError(f"pieces of {most} rows cannot keep llama.cpp's batches")
    pieces: list[int] = []
    for start in range(0, n, LLAMA_BATCH):
        m = min(LLAMA_BATCH, n - start)
        cut = [most] * (m // most) + ([m % most] if m % most else [])
        if len(cut) > 1 and cut[-1] < TILED_MIN_ROWS:      # move whole groups of rows to the last piece
            moved = -(-(TILED_MIN_ROWS - cut[-1]) // GEMM_ROWS) * GEMM_ROWS
            cut[-2] -= moved
            cut[-1] += moved
        pieces += cut
    return pieces
