"""LLVM vector IR for the AVX2 kernels: types, x86 intrinsics and llama.cpp's reduction trees.

The kernels that must round exactly as llama.cpp's AVX2 build does (kernels/cpu/qdot/,
kernels/cpu/attention.py) need shapes numba's auto-vectorizer does not produce: 8 int32 lanes of
4-byte dot products (vpmaddubsw + vpmaddwd), fused multiply-adds in a fixed lane order, and
horizontal sums in a fixed tree. So their hot loops are LLVM vector IR inside numba intrinsics,
built from the helpers here. Target: x86-64 with AVX2, FMA and F16C.
"""
from __future__ import annotations

from llvmlite import binding as _llvm, ir
from numba import njit
from numba.core import cgutils

from kernels.cpu import isa as _isa

_llvm.initialize_native_asmparser()      # inline assembly (qdot.q6_k._vpdpwssd) needs it

_FEATURES = _llvm.get_host_cpu_features()
HAS_AVX2 = all(bool(_FEATURES.get(f, False)) for f in ("avx2", "fma", "f16c"))
VNNI = HAS_AVX2 and _isa.variant() != "avx2"      # vpdpbusd on 256-bit registers (kernels.cpu.isa)
REGISTERS = 32 if _isa.variant() in ("avx512vnni", "avx512amx") else 16   # vector registers the kernels' tiles can fill
WIDE = REGISTERS == 32          # the 512-bit kernels (zmm registers) are compiled: the AVX-512 variants
AMX = _isa.variant() == "avx512amx"              # the K-quants' prompts on AMX tiles (kernels.cpu.qdot.amx)
BF16DP = WIDE and _isa.bf16_dot() == "vdpbf16ps"  # BF16 prompt tiles on vdpbf16ps (kernels.cpu.qdot.dense)
PREFETCH_LOCALITY = 3 if _isa.prefetch_target() == "l1" else 2  # llvm.prefetch's: 3 prefetcht0, 2 prefetcht1

i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
f16, f32 = ir.HalfType(), ir.FloatType()
V32B = ir.VectorType(i8, 32)     # one 256-bit register of bytes
V16S = ir.VectorType(i16, 16)    # ... of int16
V8I = ir.VectorType(i32, 8)      # ... of int32
V8F = ir.VectorType(f32, 8)      # ... of float32
V8H = ir.VectorType(f16, 8)      # 128 bits of float16 (vcvtph2ps widens them to V8F)
V16B = ir.VectorType(i8, 16)
V64B = ir.VectorType(i8, 64)     # one 512-bit register of bytes
V16I = ir.VectorType(i32, 16)    # ... of int32
V16F = ir.VectorType(f32, 16)    # ... of float32 (or two 256-bit registers, where LLVM splits the operations)


@njit(cache=True)
def not_this_variant(*args):
    """Stands in for a kernel this ISA variant does not compile (the 512-bit or the AMX ones): the
    dispatch checks WIDE / AMX / BF16DP and never calls it, but numba types every branch, so the name exists."""
    raise RuntimeError("a kernel of another ISA variant was called (the dispatch never picks it here)")


def c64(v: int) -> ir.Constant:
    return ir.Constant(i64, v)


def c32(v: int) -> ir.Constant:
    return ir.Constant(i32, v)


def vconst(vty, value) -> ir.Constant:
    return ir.Constant(vty, [value] * vty.count)


def call(builder, name: str, ret, args):
    """Call LLVM intrinsic `name` (declared on first use)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def splat(builder, value, vty):
    """A vector with `value` in every lane."""
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, value, c32(0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(i32, vty.count), [0] * vty.count))


def vload(builder, ptr, vty):
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def vstore(builder, value, ptr):
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=1)


def load_as(builder, ptr, ty, offset=0):
    """Scalar of type `ty` at byte `offset` from an i8 pointer."""
    p = builder.gep(ptr, [c64(offset)]) if isinstance(offset, int) else builder.gep(ptr, [offset])
    return builder.load(builder.bitcast(p, ty.as_pointer()), align=1)


def byte_ptr(builder, ptr):
    return builder.bitcast(ptr, i8.as_pointer())


def prefetch(builder, ptr):
    """Software prefetch of the cache line at ptr: into L1 (prefetcht0) or L2 (prefetcht1), as
    kernels.cpu.isa.prefetch_target chose for this CPU."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8.as_pointer()), c32(0), c32(PREFETCH_LOCALITY), c32(1)])


def maddubs(builder, u8, s8):
    """vpmaddubsw: u8 x s8 byte products, adjacent pairs summed into int16 (saturating; the callers'
    value ranges never saturate)."""
    return call(builder, "llvm.x86.avx2.pmadd.ub.sw", V16S, [u8, s8])


def madd16(builder, a, b):
    """vpmaddwd: int16 x int16 products, adjacent pairs summed into int32."""
    return call(builder, "llvm.x86.avx2.pmadd.wd", V8I, [a, b])


def dot4(builder, u8, s8, acc=None):
    """Per int32 lane the sum of its 4 u8 x s8 byte products (plus acc): one vpdpbusd where the chosen
    ISA has VNNI, else vpmaddubsw + vpmaddwd (+ vpaddd). The same integers either way: callers keep
    every pair of products within vpmaddubsw's int16 (they never saturate)."""
    if VNNI:
        zero = ir.Constant(V8I, [0] * 8)
        return call(builder, "llvm.x86.avx512.vpdpbusd.256", V8I,
                    [acc if acc is not None else zero, builder.bitcast(u8, V8I), builder.bitcast(s8, V8I)])
    s = madd16(builder, maddubs(builder, u8, s8), vconst(V16S, 1))
    return s if acc is None else builder.add(acc, s)


def dot4_scaled(builder, u8, s8, scales, acc):
    """acc + vpmaddwd(vpmaddubsw(u8, s8), scales): per int32 lane its 4 byte products, each pair
    times its int16 scale. With VNNI one vpdpwssd does the vpmaddwd and the add (the same integers:
    vpdpwssd's sum wraps as vpaddd does)."""
    pairs = maddubs(builder, u8, s8)
    if VNNI:
        return call(builder, "llvm.x86.avx512.vpdpwssd.256", V8I,
                    [acc, builder.bitcast(pairs, V8I), builder.bitcast(scales, V8I)])
    return builder.add(acc, madd16(builder, pairs, scales))


class Chains:
    """An integer running sum kept in `n` accumulators taken in turn, added pairwise at the end.
    The same sum as one accumulator (integer adds wrap alike in any order), but a one-row decode
    kernel then has n multiply-adds in flight instead of one chain of them each waiting on the
    last (README: measured). add(op, *args): the next accumulator becomes op(builder, *args, it),
    an op that takes its accumulator last (dot4, dot4_scaled, add_to)."""

    def __init__(self, builder, zero, n: int = 2):
        self.builder, self.parts, self.i = builder, [zero] * n, 0

    def add(self, op, *args) -> None:
        k = self.i % len(self.parts)
        self.parts[k] = op(self.builder, *args, self.parts[k])
        self.i += 1

    def total(self):
        parts = self.parts
        while len(parts) > 1:
            parts = [self.builder.add(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
        return parts[0]


def add_to(builder, v, acc):
    """acc + v, lane-wise (integers)."""
    return builder.add(acc, v)


def psign(builder, a, s):
    """vpsignb: a negated where s < 0, zeroed where s == 0."""
    return call(builder, "llvm.x86.avx2.psign.b", V32B, [a, s])


def pshufb(builder, table, idx):
    """vpshufb: byte i of each 128-bit half becomes that half's table[idx[i] & 15] (idx < 128)."""
    return call(builder, "llvm.x86.avx2.pshuf.b", V32B, [table, idx])


def fma(builder, a, b, c):
    """a * b + c with one rounding per lane (_mm256_fmadd_ps)."""
    return call(builder, "llvm.fma.v8f32", V8F, [a, b, c])


def dpbf16(builder, acc, a, b):
    """vdpbf16ps on 512-bit registers: per float lane, acc + a.hi * b.hi, rounded, then + a.lo * b.lo,
    rounded (a, b: V16I, each dword two bf16, `hi` its upper half). Declared with the dword operands
    LLVM took before it had a bfloat type; LLVM's auto-upgrade turns the call into today's form."""
    return call(builder, "llvm.x86.avx512bf16.dpbf16ps.512", V16F, [acc, a, b])


def lanes(builder, v, n=8):
    return [builder.extract_element(v, c32(k)) for k in range(n)]


def hsum8(builder, v):
    """hsum_float_8 (and tinyBLAS's hsum) of a V8F: ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7))."""
    e = lanes(builder, v)
    r = [builder.fadd(e[4 + k], e[k]) for k in range(4)]
    return builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))


def hsum8_pairs(builder, v):
    """hsum_float_8's tree, ((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7)), for the two rows a 512-bit
    register (V16F) holds at once, lane k of row h in lane 8h+k. Returns the vector whose lane 8h
    holds row h's sum."""
    for d in (4, 2, 1):
        swap = ir.Constant(ir.VectorType(i32, 16), [k ^ d for k in range(16)])
        v = builder.fadd(v, builder.shuffle_vector(v, v, swap))
    return v


def reduce4x8(builder, s):
    """GGML_F32x8_REDUCE of ggml_vec_dot_f16's four accumulators: s0+s2, s1+s3, then their sum,
    then t = lo + hi (4 lanes) and (t0+t1) + (t2+t3)."""
    x0 = builder.fadd(s[0], s[2])
    x1 = builder.fadd(s[1], s[3])
    x0 = builder.fadd(x0, x1)
    e = lanes(builder, x0)
    t = [builder.fadd(e[k], e[k + 4]) for k in range(4)]
    return builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))


def transpose(builder, vs):
    """n vectors of n lanes (rows; n a power of two) -> their transpose (vector r holds lane r of
    every input), in log2(n) butterfly stages: at stage s rows i and i+s (i & s == 0) swap their
    off-diagonal blocks of s lanes."""
    vs, n = list(vs), len(vs)
    assert n & (n - 1) == 0, n
    for s in (1 << k for k in range(n.bit_length() - 1)):
        lo = ir.Constant(ir.VectorType(i32, n), [c if c & s == 0 else n + c - s for c in range(n)])   # a_i's even blocks, a_{i+s}'s moved down
        hi = ir.Constant(ir.VectorType(i32, n), [c + s if c & s == 0 else n + c for c in range(n)])   # a_i's odd blocks moved up, a_{i+s}'s odd
        out = list(vs)
        for i in range(n):
            if not i & s:
                out[i] = builder.shuffle_vector(vs[i], vs[i + s], lo)
                out[i + s] = builder.shuffle_vector(vs[i], vs[i + s], hi)
        vs = out
    return vs


def array(context, builder, sig_arg, value):
    """numba array struct of an intrinsic argument."""
    return context.make_array(sig_arg)(context, builder, value)


def as_i64(builder, v):
    w = v.type.width
    return builder.sext(v, i64) if w < 64 else (builder.trunc(v, i64) if w > 64 else v)

