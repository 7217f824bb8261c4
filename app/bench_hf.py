"""HF transformers as a peer in `kvchat bench`: the same GGUF file, dequantized by transformers,
timed on the same prompt ids as kvchat's engines (pp, TTFT, tg with `generate`).

Local files only: nothing is ever fetched from the Hub.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import time
from pathlib import Path


def transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _sync(device: str) -> None:
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def load_transformers(path: str | Path, device: str, dtype=None):
    """transformers' AutoModelForCausalLM over the GGUF at `path` (dequantized at load) on `device`,
    in float16 on CUDA and float32 elsewhere unless `dtype` says otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # before huggingface_hub is imported: never the network
    import torch
    import transformers
    path = Path(path).resolve()
    if dtype is None:
        dtype = torch.float16 if str(device).startswith("cuda") else torch.float32
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"   # torch_dtype is deprecated since 4.56
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True, **{dtype_kw: dtype})
    return model.to(device).eval()


def weight_bytes_per_token(model) -> int:
    """Bytes of parameters a decode step reads: all of them (each shared tensor once), less the input
    embedding table unless it is also the output matrix (of which only one row is read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embd = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not embd:
        total -= embd.numel() * embd.element_size()
    return total


def time_transformers(model, prompt_ids: list[int], n_gen: int, device: str,
                      context: list[int] | None = None) -> tuple[float, float, float]:
    """(prompt_s, ttft_s, decode_s), as app.bench times kvchat's engines:
    prompt_s: one forward pass over prompt_ids from an empty cache (the KV cache built, the last
    row's logits); ttft_s: that plus the first greedy token on the host;
    decode_s: n_gen decode steps of greedy `generate` after a 1-token prompt (prompt_ids[0]), or
    after `context` + that token (decode at depth): generate makes n_gen + 1 tokens, and the clock
    runs from the first of them (the prefill's) to the last."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    # only the last row's logits, as generate() and kvchat's engines compute (logits_to_keep: 4.50 on)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    class FirstToken(StoppingCriteria):
        """Called after each generated token; notes when the first one (the prefill's) is out."""
        t = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.t is None:
                _sync(device)
                self.t = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=device)
        _sync(device)
        t0 = time.perf_counter()
        logits = model(ids, use_cache=True, **keep).logits[0, -1]
        _sync(device)
        prompt_s = time.perf_counter() - t0
        int(logits.argmax())
        ttft_s = time.perf_counter() - t0

        start = torch.tensor([list(context or []) + [prompt_ids[0]]], device=device)
        first = FirstToken()
        out = model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=n_gen + 1,
                             min_new_tokens=n_gen + 1, do_sample=False, pad_token_id=pad,
                             stopping_criteria=StoppingCriteriaList([first]))
        _sync(device)
        decode_s = time.perf_counter() - first.t
    if out.shape[1] - start.shape[1] != n_gen + 1:
        raise RuntimeError(f"transformers generated {out.shape[1] - start.shape[1]} tokens, not {n_gen + 1}")
    return prompt_s, ttft_s, decode_s
