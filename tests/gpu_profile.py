"""Where the torch engine's time goes on a GPU: a decode step's wall time replayed from CUDA graphs
and run eagerly, the eager step's kernels by their CUDA time (torch.profiler), and the same for a
512-token prompt (bench's pp512 on the GPU was 0.18-0.32x transformers' in the fifth GPU session:
this says which kernels to go after).

    python3 -m tests.gpu_profile MODEL.gguf      (tests/gpu_check.sh runs it on the 1.5B's twin)
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from core.sampler import Sampler
from core.tokenizer import Tokenizer
from core.torch_backend import TorchBackend
from core.types import SamplingParams
from models.gguf_file import open_model


def kernel_table(title: str, run) -> None:
    """run() under torch.profiler: its kernels by CUDA time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    print(f"{title}:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=50))


def main(path: str) -> None:
    g = open_model(path)
    tok = Tokenizer.from_gguf(g)
    be = TorchBackend(g, tok, 1024, "cuda")
    greedy = Sampler(SamplingParams(temperature=0.0), tok.n_vocab)
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 1000, 16)]

    def steps(n: int) -> None:
        for _ in range(n):
            be.extend_sample([7], greedy)
        torch.cuda.synchronize()

    graphs = be.graph_batch_max
    for name, batch_max in (("graphs", graphs), ("eager", 0)):
        be.seq.release()
        be.extend(prompt)
        be.graph_batch_max = batch_max
        steps(3)
        t = time.perf_counter()
        steps(30)
        dt = (time.perf_counter() - t) / 30
        print(f"decode step, {name}: {dt * 1e3:.2f} ms ({1 / dt:.1f} tokens/s)")
    kernel_table("5 eager steps", lambda: steps(5))

    long = [int(t) for t in np.random.default_rng(1).integers(10, 1000, 512)]

    def prompt_pass() -> None:
        be.seq.release()
        be.extend(long)
        torch.cuda.synchronize()

    prompt_pass()                                           # compiles and tunes for this length
    t = time.perf_counter()
    for _ in range(3):
        prompt_pass()
    dt = (time.perf_counter() - t) / 3
    print(f"prompt of {len(long)} tokens: {dt * 1e3:.1f} ms ({len(long) / dt:.0f} tokens/s)")
    kernel_table(f"one {len(long)}-token prompt", prompt_pass)


if __name__ == "__main__":
    main(sys.argv[1])
