"""kvchat's torch engine behind the Backend interface: models.torch_decoder on a torch device, with
the paged KV cache of core.kv_cache (its blocks are float16 tensors on that device) and prefix
reuse by block hash, as the native engine has.

On CUDA the Triton kernels compile for the GPU. On the CPU they run in Triton's interpreter, which
this module switches on (TRITON_INTERPRET=1) before triton is first imported: slow, but every line
of the GPU engine then runs on a machine without a GPU, which is how CI proves it.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

import numpy as np

from core.backend import Capabilities, PagedBackend
from core.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from core.tokenizer import Tokenizer
from models.architectures import load_config
from models.errors import BadInputError
from models.gguf_file import GGUFFile

Progress = Callable[[str, int, int], None]
DEVICES = ("cpu", "cuda")


def check_device(device: str) -> None:
    """A clear error (BadInputError: one line, exit 2) when `device` cannot run the torch engine here."""
    if device not in DEVICES:
        raise BadInputError(f"unknown device '{device}' (choose from {', '.join(DEVICES)})")
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        raise BadInputError("the torch engine needs Triton: pip install 'kvchat[gpu]' (triton==3.9.0)")
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
            raise BadInputError("the torch engine on the CPU needs Triton's interpreter, but triton was already "
                                "imported without TRITON_INTERPRET=1 in this process")
        os.environ["TRITON_INTERPRET"] = "1"
        return
    import torch
    if torch.version.cuda is None:
        raise BadInputError(f"--device cuda: this torch build ({torch.__version__}) has no CUDA support")
    if not torch.cuda.is_available():
        raise BadInputError("--device cuda: no CUDA device found (torch.cuda.is_available() is False)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise BadInputError("--device cuda: TRITON_INTERPRET=1 is set, which runs the kernels on the CPU")


class TorchBackend(PagedBackend):
    capabilities = Capabilities("torch", device="cpu", kv_map=True, speculative=True, batch=True)

    def __init__(self, gguf: GGUFFile, tokenizer: Tokenizer, n_ctx: int, device: str = "cpu",
                 block_size: int = DEFAULT_BLOCK_SIZE, progress: Progress | None = None,
                 n_blocks: int | None = None):
        check_device(device)
        super().__init__(tokenizer, n_ctx)
        import torch

        from models.torch_decoder import TorchDecoder
        self.capabilities = Capabilities("torch", device=device, kv_map=True, speculative=True, batch=True)
        self.torch_device = torch.device(device)
        cfg = load_config(gguf)
        if cfg.n_vocab != tokenizer.n_vocab:
            raise BadInputError(f"the model has {cfg.n_vocab} token rows, the vocabulary {tokenizer.n_vocab}")
        self.model = TorchDecoder(cfg, gguf, self.torch_device, progress)
        self.block_size = block_size
        self.cache = self.new_cache(n_blocks)
        self.seq = self.cache.new_sequence()

    def new_cache(self, n_blocks: int | None = None) -> PagedKVCache:
        cfg = self.model.cfg
        return PagedKVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, self.n_ctx, self.block_size, n_blocks,
                            storage=self.model.new_cache)

    def _forward(self, runs: Sequence[tuple], all_rows: bool = False) -> np.ndarray:
        """runs: (sequence, ids); the slots are appended, the forward pass runs, the tokens are
        committed. Float32 logits on the host (every row with all_rows, else each run's last)."""
        import torch
        segments, tokens = [], []
        for seq, ids in runs:
            start = seq.n_tokens
            seq.append_slots(len(ids))
            segments.append((seq, start, len(ids)))
            tokens.extend(ids)
        with torch.inference_mode():
            logits = self.model.forward(tokens, segments, all_rows)
        for seq, ids in runs:
            seq.commit(list(ids))
        return logits.cpu().numpy()

    def extend(self, ids: Sequence[int], vocab_limit: int | None = None) -> np.ndarray:
        logits = self._forward([(self.seq, list(ids))])[0]
        return logits if vocab_limit is None else logits[:vocab_limit]

    def verify(self, ids: Sequence[int]) -> np.ndarray:
        return self._forward([(self.seq, list(ids))], all_rows=True)

    def forward_batch(self, runs) -> np.ndarray:
        return self._forward([(seq, list(ids)) for seq, ids in runs])

    def logits_all(self, ids: Sequence[int], chunk: int = 512) -> np.ndarray:
        """Logits at every position of `ids` from an empty cache: (T, n_vocab). Tests compare it."""
        self.seq.release()
        return np.concatenate([self._forward([(self.seq, list(ids[s:s + chunk]))], all_rows=True)
                               for s in range(0, len(ids), chunk)])
