"""The CPU's int8 multiply-accumulate peak, and what a prompt of a model needs of it: how near the
compute limit prefill is, and whether a time-to-first-token target is possible at all here.

Prompts are compute-bound, and their matmuls run on vpdpbusd (four u8 x s8 products per int32
lane). This times chains of it on the widest registers the chosen kernel variant uses (zmm on the
AVX-512 variants, ymm on avxvnni), 12 independent accumulators per thread so that latency hides,
on 1 thread and on all: the ceiling no prompt kernel can pass. With a model it also counts a
prompt's multiply-accumulates: every matrix but the token table and the output head (a prompt
needs the logits of its last token only) once per token, plus attention's q.k and p.v over the
causal triangle (float, so the int8 rate flatters it), and the rate a TTFT target needs.

    python -m tests.cpu_int8_peak [MODEL.gguf [TOKENS [SECONDS]]]
"""
from __future__ import annotations

import os
import sys
import time

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu import isa

WIDTH = 16 if isa.variant() in ("avx512vnni", "avx512amx") else 8     # int32 lanes of the variant's registers
VEC = ir.VectorType(ir.IntType(32), WIDTH)
ACCUMULATORS = 12


@intrinsic
def _chains(typingctx, n):
    """n rounds of ACCUMULATORS independent vpdpbusd; returns a lane of their sum (so none is dropped)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VEC, [VEC] * 3),
                                            f"llvm.x86.avx512.vpdpbusd.{32 * WIDTH}")
        u8 = cgutils.alloca_once_value(builder, ir.Constant(VEC, [0x03030303] * WIDTH))   # loaded each round:
        s8 = cgutils.alloca_once_value(builder, ir.Constant(VEC, [0x05050505] * WIDTH))   # not folded away
        accs = [cgutils.alloca_once_value(builder, ir.Constant(VEC, [k] * WIDTH)) for k in range(ACCUMULATORS)]
        with cgutils.for_range(builder, args[0]):
            a, b = builder.load(u8), builder.load(s8)
            for acc in accs:
                builder.store(builder.call(fn, [builder.load(acc), a, b]), acc)
        total = builder.load(accs[0])
        for acc in accs[1:]:
            total = builder.add(total, builder.load(acc))
        return builder.sext(builder.extract_element(total, ir.Constant(ir.IntType(32), 0)), ir.IntType(64))
    return types.int64(n), codegen


@njit(parallel=True)
def _run(n, threads):
    s = 0
    for _ in prange(threads):
        s += _chains(n)
    return s


def peak_gmac_s(threads: int, rounds: int = 20_000_000) -> float:
    """Best of three timed runs of `rounds` rounds on each of `threads` threads, in 1e9 MAC/s."""
    _run(1000, threads)
    best = min(_timed(rounds, threads) for _ in range(3))
    return rounds * ACCUMULATORS * WIDTH * 4 * threads / best / 1e9


def _timed(rounds: int, threads: int) -> float:
    t0 = time.perf_counter()
    _run(rounds, threads)
    return time.perf_counter() - t0


def prompt_macs(path: str, tokens: int) -> tuple[float, float]:
    """(matmul, attention) multiply-accumulates of a `tokens`-token prompt of the model at path."""
    from models.gguf_file import open_model
    g = open_model(path)
    per_token = sum(t.shape[0] * t.shape[1] for name, t in g.tensors.items()
                    if len(t.shape) == 2 and not name.startswith(("token_embd", "output")))
    heads = g.arch_get("attention.head_count")
    hd = g.arch_get("attention.key_length") or g.arch_get("embedding_length") // heads
    attention = g.arch_get("block_count") * heads * hd * 2 * tokens * (tokens + 1) / 2
    return per_token * tokens, attention


def main(argv: list[str]) -> None:
    if isa.variant() == "avx2":
        sys.exit("this kernel variant has no vpdpbusd (avx2: vpmaddubsw + vpmaddwd)")
    threads = os.cpu_count() or 1
    one, all_ = peak_gmac_s(1), peak_gmac_s(threads)
    print(f"vpdpbusd on {32 * WIDTH}-bit registers ({isa.variant()}): {one:.0f} GMAC/s on 1 thread, "
          f"{all_:.0f} on {threads}")
    if argv:
        tokens = int(argv[1]) if len(argv) > 1 else 4096
        mm, att = prompt_macs(argv[0], tokens)
        print(f"a {tokens}-token prompt: {mm / 1e12:.2f} T MAC in matmuls, {att / 1e12:.2f} T in attention; "
              f"at the peak {(mm + att) / all_ / 1e9:.1f} s")
        if len(argv) > 2:
            need = (mm + att) / float(argv[2]) / 1e9
            print(f"a TTFT of {argv[2]} s needs {need:.0f} GMAC/s, {need / all_:.0%} of the peak")


if __name__ == "__main__":
    main(sys.argv[1:])
