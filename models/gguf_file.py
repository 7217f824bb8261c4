"""Open a GGUF file as untrusted input: validate everything at parse time, then expose a small API.

Parsing is the `gguf` package's memory-mapped GGUFReader. On top of it we check what it does not:
the file size, that every tensor lies inside the file, that the architecture and every tensor type
are ones kvchat can run. Every failure is a BadInputError with a one-line message.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES

from models.errors import BadInputError

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
SUPPORTED_TYPES = frozenset(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]      # ggml order: shape[0] is the contiguous (row) dimension
    n_elements: int
    n_bytes: int
    offset: int                 # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


class GGUFFile:
    """A validated GGUF model file. `reader` is the underlying gguf.GGUFReader (memory-mapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise BadInputError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise BadInputError(f"not a file: {self.path}")
        self.file_size = self.path.stat().st_size
        if self.file_size == 0:
            raise BadInputError(f"model file is empty: {self.path}")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise BadInputError(f"not a GGUF file (bad magic {magic!r}): {self.path}")
        try:
            self.reader = GGUFReader(self.path, "r")
        except Exception as e:  # the reader fails in many ways on damaged input; all mean the same to a user
            if "cannot reshape array" in str(e):   # the reader's symptom of tensor data beyond the end
                raise BadInputError(f"a tensor in {self.path.name} points past the end of the file "
                                    "(truncated or corrupt)") from None
            raise BadInputError(f"corrupt or truncated GGUF file {self.path.name}: {_one_line(e)}") from None
        self.tensors = self._validate_tensors()
        self.arch = self.get("general.architecture")
        if self.arch is None:
            raise BadInputError(f"GGUF file {self.path.name} has no general.architecture")

    def _validate_tensors(self) -> dict[str, TensorInfo]:
        tensors = {}
        for t in self.reader.tensors:
            ggml_type = int(t.tensor_type)
            shape = tuple(int(x) for x in t.shape)
            n_elements = int(np.prod(shape)) if shape else 1
            try:
                block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (KeyError, ValueError):
                raise BadInputError(f"tensor {t.name} has unknown ggml type {ggml_type}") from None
            n_bytes = n_elements // block_elems * block_bytes
            offset = int(t.data_offset)
            if offset < 0 or offset + n_bytes > self.file_size:
                raise BadInputError(f"tensor {t.name} points past the end of the file "
                                    f"({offset + n_bytes} > {self.file_size} bytes): the file is truncated or corrupt")
            tensors[t.name] = TensorInfo(t.name, ggml_type, shape, n_elements, n_bytes, offset)
        return tensors

    # --- metadata --------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python object (str, int, float, bool or list), or `default`."""
        field = self.reader.get_field(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception:
            raise BadInputError(f"metadata {key} in {self.path.name} is corrupt") from None

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """`{arch}.{suffix}`, e.g. arch_get('context_length')."""
        return self.get(f"{self.arch}.{suffix}", default)

    @cached_property
    def chat_template(self) -> str | None:
        return self.get("tokenizer.chat_template")

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    @property
    def type_counts(self) -> Counter:
        return Counter(t.type_name for t in self.tensors.values())

    def tensor_data(self, name: str) -> np.ndarray:
        """The raw memory-mapped data of a tensor (typed for F32/F16/BF16... as the reader gives it)."""
        for t in self.reader.tensors:
            if t.name == name:
                return t.data
        raise BadInputError(f"tensor {name} missing from {self.path.name}")

    # --- checks the engines need -----------------------------------------------------------
    def require_supported(self) -> "GGUFFile":
        """Refuse architectures and tensor types kvchat cannot run."""
        if self.arch not in SUPPORTED_ARCHS:
            raise BadInputError(f"unsupported architecture '{self.arch}' in {self.path.name} "
                                f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        for t in self.tensors.values():
            if t.ggml_type not in SUPPORTED_TYPES:
                raise BadInputError(f"unsupported tensor type {t.type_name} (tensor {t.name}) in {self.path.name}")
        return self

    def info(self) -> dict:
        """What `kvchat models info` prints."""
        return {
            "path": str(self.path),
            "architecture": self.arch,
            "name": self.get("general.name"),
            "parameters": self.n_params,
            "tensor_types": dict(sorted(self.type_counts.items())),
            "context_length": self.arch_get("context_length"),
            "chat_template": self.chat_template is not None,
            "file_size": self.file_size,
        }


def open_model(path: str | Path) -> GGUFFile:
    """Open and fully validate a model kvchat can run."""
    return GGUFFile(path).require_supported()


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
