"""dequant_gemv's kernels and tile shapes on the 1.5B registry model's decode shapes, on a GPU: the
time of each (BLOCK_R, BLOCK_K, num_warps, per_column), the engine's own choice first, and every
tile's products checked against it. The weights are random bytes with sane f16 scales: the
kernel's speed does not depend on the values. Prints every tile per shape, fastest first, and the
sum over the shapes. Each shape's first tile (the default) is timed first, and on the small shapes
its time can run high.

    python3 -m tests.gpu_gemv_sweep          (tests/gpu_check.sh runs it)
"""
from __future__ import annotations

import torch
import triton

from kernels.cuda.dequant_gemv import QK, dequant_gemv
from kernels.types import Q4_K, Q6_K, Q8_0

# (type, N, K): q/o, k, gate/up (Q4_K); down, v, output (Q6_K) of qwen2.5-coder-1.5b-instruct;
# Q8_0 at q/o's shape
SHAPES = [(Q8_0, 1536, 1536), (Q4_K, 1536, 1536), (Q4_K, 256, 1536), (Q4_K, 8960, 1536), (Q6_K, 1536, 8960),
          (Q6_K, 256, 1536), (Q6_K, 151936, 1536)]
# (0, 0, 0, False): dequant_gemv's default; per_column=True: the per-column kernel for the K-quants
# too (Q8_0 always takes it, so its rows are all per column)
TILES = [(0, 0, 0, False), (1, 256, 1, False), (1, 256, 2, False), (1, 512, 1, False), (1, 512, 2, False),
         (1, 1024, 4, False), (2, 256, 2, False), (2, 512, 4, False), (4, 256, 4, False), (4, 512, 4, False),
         (8, 256, 4, False), (1, 256, 1, True), (1, 512, 2, True),
         # more bytes in flight per program: four or eight K-quant blocks a step, two or four rows
         (1, 1024, 1, False), (1, 1024, 2, False), (1, 2048, 2, False), (2, 512, 1, False), (2, 512, 2, False),
         (2, 1024, 2, False), (4, 512, 2, False)]


def random_blocks(t: int, n: int, k: int) -> torch.Tensor:
    """(n, row bytes) random blocks whose f16 scales are all 2^-10 (bytes 00 14), not inf or NaN."""
    per, nb = QK[t]
    w = torch.randint(0, 256, (n, k // per, nb), dtype=torch.uint8, device="cuda")
    for at in {Q6_K: (208,), Q4_K: (0, 2), Q8_0: (0,)}[t]:      # the f16 scales: d (and Q4_K's dmin)
        w[:, :, at], w[:, :, at + 1] = 0x00, 0x14
    return w.view(n, -1)


def main() -> None:
    total = dict.fromkeys(TILES, 0.0)
    for t, n, k in SHAPES:
        w, x = random_blocks(t, n, k), torch.randn(1, k, device="cuda")
        base, rows = None, []
        for tile in TILES:
            def f():
                return dequant_gemv(w, t, k, x, *tile)
            y = f()
            base = y if base is None else base
            err = float((y - base).abs().max() / base.abs().max())
            s = triton.testing.do_bench(f, warmup=5, rep=25) * 1e-3
            total[tile] += s
            rows.append((s, tile, err))
        print(f"type {t} N {n} K {k} ({w.numel() / 1e6:.1f} MB): default {rows[0][0] * 1e6:.1f} us")
        for s, tile, err in sorted(rows):
            print(f"   {tile}: {s * 1e6:8.1f} us {w.numel() / s / 1e9:6.0f} GB/s  error {err:.1e}")
        assert all(err < 1e-4 for _, _, err in rows), rows
    print("sum over the shapes, fastest first:")
    for tile, s in sorted(total.items(), key=lambda kv: kv[1])[:6]:
        print(f"   {tile}: {s * 1e6:.1f} us")


if __name__ == "__main__":
    main()
