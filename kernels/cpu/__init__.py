"""CPU kernels (numba): GGML dequantization, exact quantized matmuls, norms/rope/activations, paged attention,
and the decoder layer that chains them (fused)."""
from kernels.cpu import isa

isa.apply()   # before any kernel compiles: KVCHAT_ISA picks the instruction set

from kernels.cpu.attention import (attention_decode, attention_decode_rows, attention_prefill, block_slots, write_kv,
                                  write_kv_slots)
from kernels.cpu.matmul import QMatrix
from kernels.cpu.ops import geglu_tanh, rms_norm, rope, rope_table, softmax, swiglu
from kernels.cpu.quant import GGML_BLOCK, SUPPORTED_TYPES, dequantize

__all__ = [
    "GGML_BLOCK", "SUPPORTED_TYPES", "dequantize", "QMatrix",
    "rms_norm", "rope", "rope_table", "swiglu", "geglu_tanh", "softmax",
    "write_kv", "write_kv_slots", "block_slots", "attention_prefill", "attention_decode", "attention_decode_rows",
]
