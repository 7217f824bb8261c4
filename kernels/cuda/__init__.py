"""CUDA kernels: Triton, launched from torch. Each kernel sits beside the launcher that sizes its grid.

  attention.py     flash prefill over the paged KV cache (causal, GQA, sliding window, cached
                   prefix) and split-KV flash-decoding with a log-sum-exp merge
  dequant.py       GGUF rows -> dense fp16/fp32 (prefill's one-matrix scratch, embedding row gathers)
  dequant_gemv.py  y = W @ x straight from GGUF blocks (Q8_0, Q5_0, Q4_K, Q6_K)
  norm_rope.py     RMSNorm, ggml RoPE (neox / normal), and the two fused per head

Importing this package imports neither triton nor the kernel modules (triton is a test/cuda
extra, not a CPU-install dependency): import `kernels.cuda.attention` etc. where needed.
Tests run every kernel on the CPU with TRITON_INTERPRET=1 and CPU tensors.

The torch engine (core.torch_backend, models.torch_decoder) runs them:
  * Weights stay as GGUF blocks (uint8) in device memory; decode rows run the dequant-in-register
    GEMV, reading 4.5-8.5 bits per weight instead of 16. Prompts dequantize one matrix at a time
    into a scratch buffer (dequant.py) and multiply it with torch.matmul; only types without
    these kernels keep a dequantized copy, made at load.
  * The KV cache keeps the CPU engine's paged layout (n_blocks, block_size, Hkv, hd) per layer,
    in fp16 on the device, with core.kv_cache's block tables and prefix reuse.
  * A decode step's launches read nothing back to the host (attention_decode's split count
    comes from the table width, each split's key range from seq_lens on the device), so CUDA
    graphs capture it.
"""
from kernels.types import Q4_K, Q5_0, Q6_K, Q8_0

# the GGUF types dequant_gemv reads in place; the torch engine dequantizes the others at load
GEMV_TYPES = (Q8_0, Q5_0, Q4_K, Q6_K)
