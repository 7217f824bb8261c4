"""An Engine is one loaded model: its validated GGUF, tokenizer, chat template and backend.

It is what the CLI and the TUI hold. It turns a conversation (or a raw prompt) into token ids and
streams TokenEvents from the backend.
"""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from core.backend import Backend
from core.types import SamplingParams, SpeculativeConfig, TokenEvent
from core.chat_template import ChatTemplate, transcript
from core.tokenizer import Tokenizer
from models import registry
from models.errors import BadInputError
from models.gguf_file import GGUFFile, open_model

BACKEND_NAMES = ("auto", "native", "llama.cpp", "torch", "openai")   # openai: a server (core.remote_engine)
DEVICE_NAMES = ("auto", "cpu", "cuda")
DEFAULT_CTX = 4096


# The backend `run`, `chat` and `batch` use when none is named: kvchat's own engine (faster than
# llama.cpp here on decode, prefill and TTFT, with prefix reuse, speculation and the KV map) for every
# file it runs, and llama.cpp for the rest (Engine says so on stderr).
DEFAULT_BACKEND = "auto"


def cuda_available() -> bool:
    """A CUDA device torch can use. Without an NVIDIA driver this does not import torch (seconds)."""
    if not os.path.exists("/proc/driver/nvidia/version") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pick_backend(backend: str | None, device: str) -> tuple[str, str]:
    """(backend, device) for --backend and --device: the torch engine runs on CUDA (or, named
    with --device cpu, on the CPU under Triton's interpreter); the others run on the CPU. Device
    auto takes CUDA when there is one and no CPU-only backend was named. The backend may stay
    "auto" (no GPU): Engine settles it once it has read the file (settle)."""
    if device not in DEVICE_NAMES:
        raise BadInputError(f"unknown device '{device}' (choose from {', '.join(DEVICE_NAMES)})")
    if backend is not None and backend not in BACKEND_NAMES:
        raise BadInputError(f"unknown backend '{backend}' (choose from {', '.join(BACKEND_NAMES)})")
    backend = backend or DEFAULT_BACKEND
    if backend == "openai":
        raise BadInputError("--backend openai talks to a server: it needs --base-url URL")
    if device == "cuda":
        if backend not in ("auto", "torch"):
            raise BadInputError(f"--device cuda runs the torch engine; the {backend} backend runs on the CPU")
        from core.torch_backend import check_device
        check_device("cuda")
        return "torch", "cuda"
    if device == "auto" and backend in ("auto", "torch") and cuda_available():
        return "torch", "cuda"
    return backend, "cpu"


def settle(backend: str, device: str, gguf: GGUFFile, n_ctx: int, auto_backend: bool,
           auto_device: bool, note: Callable[[str], None]) -> tuple[str, str, str | None]:
    """pick_backend's choice once the file is read: (backend, device, what kvchat's engine lacks).
    --backend auto runs kvchat's engine (the torch one where pick_backend chose CUDA) when it runs
    this file's architecture and tensor types, else llama.cpp on the CPU (the third item says
    why). --device auto leaves CUDA for the native engine when the model and its KV cache do not
    fit in the GPU's free memory (said through `note`)."""
    if auto_backend and not (device == "cuda" and not auto_device):    # (--device cuda: the torch engine only)
        lacks = gguf.unsupported(cpu=device != "cuda", n_ctx=n_ctx)
        if lacks is not None:
            return "llama.cpp", "cpu", lacks
        backend = "native" if backend == "auto" else backend
    if auto_device and device == "cuda":
        from core.torch_backend import cuda_fits
        fits, why = cuda_fits(gguf, n_ctx)
        if not fits:
            note(f"{why}; running on the CPU")
            return "native", "cpu", None
    return backend, device, None


def load_backend(name: str, gguf: GGUFFile, tokenizer: Tokenizer, n_ctx: int, threads: int | None,
                 progress: registry.Progress | None = None, device: str = "cpu") -> Backend:
    if name == "torch":
        from core.torch_backend import TorchBackend
        return TorchBackend(gguf, tokenizer, n_ctx, device, progress=progress)
    if name == "llama.cpp":
        from core.llamacpp_backend import LlamaCppBackend
        return LlamaCppBackend(gguf, tokenizer, n_ctx, threads)
    if name == "native":
        from core.native_backend import NativeBackend
        return NativeBackend(gguf, tokenizer, n_ctx, threads, progress=progress)
    raise BadInputError(f"unknown backend '{name}' (choose from {', '.join(BACKEND_NAMES)})")


def load_backend_or_cpu(name: str, gguf: GGUFFile, tokenizer: Tokenizer, n_ctx: int, threads: int | None,
                        progress: registry.Progress | None, device: str, auto: bool,
                        note: Callable[[str], None]) -> Backend:
    """load_backend; on CUDA, running out of device memory is one line: under --device auto the
    CPU engine takes over (said through `note`), under --device cuda it is a BadInputError (exit 2)."""
    try:
        return load_backend(name, gguf, tokenizer, n_ctx, threads, progress, device)
    except Exception as e:
        if device != "cuda":
            raise
        import torch
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)):
            raise
        line = f"out of GPU memory loading {gguf.path.name} ({str(e).splitlines()[0] if str(e) else 'no detail'})"
    import gc
    gc.collect()                       # the half-built engine's tensors, before the cache is emptied
    torch.cuda.empty_cache()
    if not auto:
        raise BadInputError(line + "; try --device cpu or a smaller --ctx")
    note(f"{line}; running on the CPU")
    return load_backend("native", gguf, tokenizer, n_ctx, threads, progress, "cpu")


def open_engine(model: str = registry.DEFAULT_MODEL, backend: str | None = None, base_url: str | None = None,
                api_key: str | None = None, **engine_args):
    """The one place run, batch and the chat make their engine: a RemoteEngine for --backend openai
    (a server at base_url; the local-model arguments do not apply), else an Engine."""
    if (backend == "openai") != (base_url is not None):
        raise BadInputError("--base-url goes with --backend openai" if base_url is not None
                            else "--backend openai needs --base-url URL (e.g. http://127.0.0.1:8080/v1)")
    if backend == "openai":
        from core.remote_engine import RemoteEngine
        return RemoteEngine(model, base_url, api_key)
    if api_key is not None:
        raise BadInputError("--api-key goes with --backend openai")
    return Engine(model, backend=backend, **engine_args)


@dataclass
class Message:
    role: str
    content: str


class Engine:
    def __init__(self, model: str = registry.DEFAULT_MODEL, backend: str | None = None, n_ctx: int = DEFAULT_CTX,
                 threads: int | None = None, progress: registry.Progress | None = None,
                 backend_progress: registry.Progress | None = None, device: str = "auto",
                 kv_disk: bool | None = None, kv_disk_max: int | None = None):
        """progress: the model pull; backend_progress: loading weights and preparing kernels (the
        TUI's bar; without it the native backend reports on stderr when that is a terminal);
        device: auto, cpu or cuda (pick_backend); kv_disk: keep full KV blocks on disk across runs
        (core.kv_disk; None: KVCHAT_KV_DISK=on|off, else the `kvchat cache on|off` setting, else
        on), in at most kv_disk_max bytes."""
        if kv_disk is None:
            from core.kv_disk import enabled_by_default
            kv_disk = enabled_by_default()       # before the load: a bad KVCHAT_KV_DISK costs no wait
        if n_ctx < 16:
            raise BadInputError("--ctx must be at least 16")
        if threads is not None and not 1 <= threads <= (os.cpu_count() or 1) * 4:
            raise BadInputError(f"--threads must be between 1 and {(os.cpu_count() or 1) * 4}")
        self.model_name = model
        auto, auto_backend = device == "auto", backend in (None, "auto")
        backend, device = pick_backend(backend, device)
        self.path = registry.resolve(model, progress)
        self.gguf = open_model(self.path)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        source = self.gguf.chat_template
        bos = self.tokenizer.tokens[self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else ""
        eos = self.tokenizer.tokens[self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else ""
        self.template = ChatTemplate(source, bos, eos) if source else None
        train_ctx = self.gguf.arch_get("context_length") or n_ctx
        self.n_ctx = min(n_ctx, int(train_ctx))
        self.threads, self.progress, self.backend_progress = threads, progress, backend_progress
        self.notes: list[str] = []    # what chose another engine or device than asked: stderr, the TUI's toasts
        backend, device, lacks = settle(backend, device, self.gguf, self.n_ctx, auto_backend, auto, self._note)
        try:
            self.backend = load_backend_or_cpu(backend, self.gguf, self.tokenizer, self.n_ctx, threads,
                                               backend_progress, device, auto, self._note)
        except BadInputError as e:
            if lacks is None:
                raise
            raise BadInputError(f"kvchat's engine does not run {lacks}, and {e}") from None
        if lacks is not None:
            self._note(f"kvchat's engine does not run {lacks} yet; using llama.cpp")
        self.backend_name = self.backend.name
        self.kv_disk = kv_disk and self.backend.capabilities.kv_disk
        if self.kv_disk:
            self.backend.attach_disk(self.path, kv_disk_max, self._note)
        self._draft: tuple[str, Backend] | None = None   # (draft model name, its native backend)

    def _note(self, line: str) -> None:
        self.notes.append(line)
        print(f"kvchat: {line}", file=sys.stderr)

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    @property
    def device(self) -> str:
        return self.backend.device

    def prompt_ids(self, messages: Sequence[Message | dict] | str, chat: bool = True) -> list[int]:
        """Token ids for a conversation (through the chat template) or for raw text (plain completion).
        Without a template (a base model) a conversation is a plain transcript: its messages joined by
        blank lines, except that a reply continues the text before it, as the model wrote it. So the
        next turn's prompt starts with the tokens the KV cache already holds, reply included."""
        if isinstance(messages, str):
            messages = [Message("user", messages)]
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        tok = self.tokenizer
        if chat and self.template is not None:
            text = self.template.render(msgs, add_generation_prompt=True)
            bos_text = tok.tokens[tok.bos_id] if tok.bos_id is not None else None
            add_bos = tok.add_bos and not (bos_text and text.startswith(bos_text))
            return tok.encode(text, add_bos=add_bos, special=True)
        return tok.encode(transcript(msgs), add_bos=tok.add_bos, special=False)

    def count_tokens(self, text: str) -> int:
        """How many tokens a text is on its own (no BOS; special tokens' text as plain text): what
        an attached file adds to a message."""
        return len(self.tokenizer.encode(text))

    def draft_backend(self, draft_model: str) -> Backend:
        """The native backend of a draft model for speculative decoding, loaded on first use and
        kept. Its vocabulary must be the target's token for token (drafts are token ids)."""
        if self._draft is not None and self._draft[0] == draft_model:
            return self._draft[1]
        if self._draft is not None:
            self._draft[1].close()
            self._draft = None
        g = open_model(registry.resolve(draft_model, self.progress)).require_supported(n_ctx=self.n_ctx)
        tokenizer = Tokenizer.from_gguf(g)
        if tokenizer.tokens != self.tokenizer.tokens:
            raise BadInputError(f"the draft model {draft_model} has a different vocabulary from {self.model_name}")
        from core.native_backend import NativeBackend
        self._draft = (draft_model, NativeBackend(g, tokenizer, self.n_ctx, self.threads,
                                                  progress=self.backend_progress))
        return self._draft[1]

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None,
                 speculative: SpeculativeConfig | None = None) -> Iterator[TokenEvent]:
        draft = None
        if speculative is not None and speculative.method == "draft" and self.backend.capabilities.speculative:
            draft = self.draft_backend(speculative.draft_model)
        return self.backend.generate(prompt_ids, params, cancel, speculative, draft)

    def close(self) -> None:
        if self._draft is not None:
            self._draft[1].close()
        self.backend.close()
