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
from kernels.types import LLAMA_BATCH
from models.architectures import load_config
from models.errors import BadInputError, env_choice
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


def cuda_tensor_bytes(t) -> int:
    """A GGUF tensor's bytes as the torch engine keeps it on CUDA (models.torch_decoder): a matrix of
    a type the Triton kernels read (kernels.cuda.GEMV_TYPES) as its GGUF blocks, any other matrix
    as a float16 copy, a vector in float32."""
    from kernels.cuda import GEMV_TYPES
    n = int(np.prod(t.shape))
    if len(t.shape) < 2:
        return 4 * n
    return t.n_bytes if t.ggml_type in GEMV_TYPES else 2 * n


def device_bytes(gguf: GGUFFile, n_ctx: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """What the torch engine takes in CUDA memory for this model and context: the weights as
    models.torch_decoder keeps them (GGUF blocks for the types its kernels read, fp16 copies of the
    rest), the scratch matrix prompts dequantize into, the KV cache with its pad block, and room
    for a prompt's activations and a batch's logits."""
    from kernels.cuda import GEMV_TYPES
    cfg = load_config(gguf)
    weights = sum(cuda_tensor_bytes(t) for t in gguf.tensors.values())
    scratch = max((2 * int(np.prod(t.shape)) for t in gguf.tensors.values() if t.ggml_type in GEMV_TYPES
                   and len(t.shape) == 2), default=0)
    kv = 2 * cfg.n_layer * (-(-n_ctx // block_size) + 1) * block_size * cfg.n_head_kv * cfg.head_dim * 2
    activations = 4 * 512 * (4 * cfg.n_embd + 3 * cfg.n_ff) + 4 * 32 * cfg.n_vocab + (256 << 20)
    return weights + scratch + kv + activations


def cuda_fits(gguf: GGUFFile, n_ctx: int) -> tuple[bool, str]:
    """Does the model with an n_ctx cache fit in the CUDA device's free memory? (yes, or no and a
    line saying how much it needs and how much is free)."""
    import torch
    try:
        free, _ = torch.cuda.mem_get_info()
    except RuntimeError as e:          # a full device cannot even make a context
        return False, f"the GPU's free memory could not be read ({str(e).splitlines()[0]})"
    need = device_bytes(gguf, n_ctx)
    return need <= free, f"the model and its KV cache need {need / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB are free"


class TorchBackend(PagedBackend):
    capabilities = Capabilities("torch", device="cpu", kv_map=True, kv_disk=True, speculative=True, batch=True)

    def __init__(self, gguf: GGUFFile, tokenizer: Tokenizer, n_ctx: int, device: str = "cpu",
                 block_size: int = DEFAULT_BLOCK_SIZE, progress: Progress | None = None,
                 n_blocks: int | None = None, float16: bool | None = None):
        """float16: the GPU's float16 weights and products on any device (None: on CUDA only;
        models.torch_decoder.TorchDecoder)."""
        check_device(device)
        # read before the load: a bad KVCHAT_CUDA_GRAPHS costs no wait
        graphs_on = env_choice("KVCHAT_CUDA_GRAPHS", ("0", "1"), "1") == "1" and device == "cuda"
        gguf.require_supported(cpu=False, n_ctx=n_ctx)
        super().__init__(tokenizer, n_ctx)
        import torch

        from models.torch_decoder import GRAPH_BATCHES, TorchDecoder
        self.capabilities = Capabilities("torch", device=device, kv_map=True, kv_disk=True, speculative=True,
                                         batch=True)
        self.torch_device = torch.device(device)
        cfg = load_config(gguf, n_ctx)
        if cfg.n_vocab != tokenizer.n_vocab:
            raise BadInputError(f"the model has {cfg.n_vocab} token rows, the vocabulary {tokenizer.n_vocab}")
        self.model = TorchDecoder(cfg, gguf, self.torch_device, progress, float16)
        self.block_size = block_size
        self.cache = self.new_cache(n_blocks)
        self.seq = self.cache.new_sequence()
        # decode steps of up to this many sequences replay CUDA graphs (0: none; on the CPU, or with
        # KVCHAT_CUDA_GRAPHS=0, to tell a graph problem from another)
        # (a mixture of experts' decode step reads its routing back to the host: no graphs)
        self.graph_batch_max = GRAPH_BATCHES[-1] if graphs_on and not cfg.n_expert else 0
        self._graphs = None

    def new_cache(self, n_blocks: int | None = None) -> PagedKVCache:
        self._drop_graphs()
        cfg = self.model.cfg
        return PagedKVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, self.n_ctx, self.block_size, n_blocks,
                            storage=self.model.new_cache)

    def kv_arithmetic(self) -> str:
        import torch
        where = torch.cuda.get_device_name(self.torch_device) if self.device == "cuda" else "cpu"
        return f"torch/{where}/f16"

    def _drop_graphs(self) -> None:
        """Forget the decode graphs (they hold a cache's tensors) and give their memory back."""
        if getattr(self, "_graphs", None) is not None:
            self._graphs = None
            import torch
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._drop_graphs()
        super().close()

    def _decode_graphs(self):
        """The CUDA graphs of the decode step for the current cache (captured batch by batch)."""
        from models.torch_decoder import DecodeGraphs
        if self._graphs is None or self._graphs.k_cache is not self.cache.k:
            self._graphs = DecodeGraphs(self.model, self.cache.k, self.cache.v, self.n_ctx)
        return self._graphs

    def _forward(self, runs: Sequence[tuple], all_rows: bool = False) -> np.ndarray:
        """Float32 logits on the host (every row with all_rows, else each run's last)."""
        return self._forward_device(runs, all_rows).cpu().numpy()

    def _forward_device(self, runs: Sequence[tuple], all_rows: bool = False):
        """runs: (sequence, ids); the slots are appended, the forward pass runs, the tokens are
        committed. The float32 logits stay on the device."""
        import torch
        segments, tokens = [], []
        for seq, ids in runs:
            start = seq.n_tokens
            seq.append_slots(len(ids))
            segments.append((seq, start, len(ids)))
            tokens.extend(ids)
        with torch.inference_mode():
            if len(runs) <= self.graph_batch_max and all(n == 1 for _, _, n in segments):
                logits = self._decode_graphs()(tokens, segments)
            else:
                logits = self.model.forward(tokens, segments, all_rows)
        for seq, ids in runs:
            seq.commit(list(ids))
        return logits

    def extend(self, ids: Sequence[int], vocab_limit: int | None = None) -> np.ndarray:
        logits = self._forward([(self.seq, list(ids))])[0]
        return logits if vocab_limit is None else logits[:vocab_limit]

    def extend_sample(self, ids: Sequence[int], sampler) -> int:
        """The logits stay on the device; only the sampled id comes back (core.device_sampling)."""
        import torch

        from core.device_sampling import sample_on_device
        logits = self._forward_device([(self.seq, list(ids))])[0]
        with torch.inference_mode():
            return sample_on_device(sampler, logits)

    def verify(self, ids: Sequence[int]) -> np.ndarray:
        return self._forward([(self.seq, list(ids))], all_rows=True)

    def forward_batch(self, runs) -> np.ndarray:
        return self._forward([(seq, list(ids)) for seq, ids in runs])

    def logits_all(self, ids: Sequence[int], chunk: int = LLAMA_BATCH) -> np.ndarray:
        """Logits at every position of `ids` from an empty cache: (T, n_vocab). Tests compare it."""
        self.seq.release()
        return np.concatenate([self._forward([(self.seq, list(ids[s:s + chunk]))], all_rows=True)
                               for s in range(0, len(ids), chunk)])
