"""CUDA kernels: Triton, launched from torch. Each kernel sits beside the launcher that sizes its grid.

  attention.py     flash prefill over the paged KV cache (causal, GQA, sliding window, cached
                   prefix) and split-KV flash-decoding with a log-sum-exp merge
  dequant_gemv.py  y = W @ x straight from GGUF blocks (Q8_0, Q5_0, Q4_K, Q6_K)
  norm_rope.py     RMSNorm, ggml RoPE (neox / normal), and the two fused per head

Importing this package imports neither triton nor the kernel modules (triton is a test/cuda
extra, not a CPU-install dependency): import `kernels.cuda.attention` etc. where needed.
Tests run every kernel on the CPU with TRITON_INTERPRET=1 and CPU tensors.

Intended CUDA backend (not wired yet; issue 6):
  * Weights stay as GGUF blocks (uint8) in GPU memory. Decode (batch 1, memory-bound) runs the
    dequant-in-register GEMV, reading 4.5-8.5 bits per weight instead of 16.
  * Prefill (compute-bound) dequantizes each weight once to bf16 (at load, or per layer into a
    reused buffer) and uses cuBLAS GEMM via torch; flash prefill for attention.
  * The KV cache keeps the CPU engine's paged layout (n_blocks, block_size, Hkv, hd) per layer,
    in fp16/bf16 on the GPU; block tables and sequence lengths live on the device.
  * The decode step is captured once in a CUDA graph with static buffers sized by the context:
    attention_decode's split count is fixed from the context size (max_kv) while the key range
    of each split is derived on the device from seq_lens, so replays need no recapture.
    Sampling runs on the GPU; the host syncs only to emit the token.
"""
