"""A first start's kernels compiled in two processes at once.

numba compiles one function at a time on one core, and a machine's first start (or the first after
the kernels change) spends minutes there before the model answers. The layer's kernels split into
two shares that share no function (kernels.cpu.fused.share_signatures): attention's, and the
matmuls'. compile_in_two hands attention's signatures to a second process (`python -m
core.precompile`, reading them pickled on stdin) and compiles the matmuls' meanwhile; both land in
numba's cache, and the warm-up pass that follows links them into the layer loop instead of
compiling them again. Where the second process fails, the warm-up compiles what it lacks itself:
only the time is lost.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile

import numpy as np

from core.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from kernels.cpu import fused

# Tokens of the pass the shares are typed by: a prompt's (several rows), as the warm-up's first pass.
_TOKENS = 5


def first_layer_args(model) -> tuple:
    """fused.layer's arguments for the first layer of a _TOKENS-token prompt, on a small cache of
    their own (the kernels' types do not depend on the sizes)."""
    cfg = model.cfg
    cache = PagedKVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, _TOKENS, DEFAULT_BLOCK_SIZE)
    seq = cache.new_sequence()
    seq.append_slots(_TOKENS)
    return model.layer_args(np.zeros(_TOKENS, np.int64), 0, seq)


def by_name(calls: list) -> bytes:
    """[(kernel, signature)] pickled as [(its name in kernels.cpu.fused, signature)]."""
    return pickle.dumps([(kernel.py_func.__name__, sig) for kernel, sig in calls])


def compile_in_two(model) -> str | None:
    """Compile the layer's kernels for this model into numba's cache: attention's share in a second
    process, the matmuls' here. Returns None, or what went wrong in the second process (its last
    line)."""
    args = first_layer_args(model)
    with tempfile.TemporaryFile() as err:
        helper = subprocess.Popen([sys.executable, "-m", "core.precompile"], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=err)
        try:
            helper.stdin.write(by_name(fused.share_signatures(args, "attention")))
            helper.stdin.close()
        except BrokenPipeError:                  # it failed before reading: its stderr says why
            pass
        try:
            for kernel, sig in fused.share_signatures(args, "matmuls"):
                kernel.compile(sig)
        finally:
            helper.wait()
        if helper.returncode == 0:
            return None
        err.seek(0)
        lines = err.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit status {helper.returncode}"


def main() -> int:
    """Compile the kernels named on stdin (by_name's pickle, from compile_in_two) into numba's
    cache; print each one's name and whether numba's cache held it."""
    try:
        calls = [(getattr(fused, name), sig) for name, sig in pickle.load(sys.stdin.buffer)]
    except Exception as e:                       # noqa: BLE001 (any unpickling error: one line)
        print(f"kvchat precompile: stdin holds no kernels to compile ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    for kernel, sig in calls:
        kernel.compile(sig)
        print(kernel.py_func.__name__, "loaded" if kernel.stats.cache_hits[sig] else "compiled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
