"""Open a GGUF file as untrusted input: validate everything at parse time, then expose a small API.

The parser is ours and table-driven (type id -> struct format), because gguf's GGUFReader builds a
numpy view per vocabulary string and takes ~10-20 s on a 262k-token vocabulary; this one takes
well under a second. Every read is bounds-checked, so damage of any kind (a truncated header, a
length that runs past the end, a tensor outside the file, an unknown architecture or tensor type)
is a BadInputError with a one-line message. Tensor data is memory-mapped, laid out as
gguf.GGUFReader lays it out (typed arrays for F32/F16, uint8 rows of blocks otherwise); `resident`
reads a tensor into the process's memory instead (weights_in_memory says when).
"""
from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from kernels.types import SUPPORTED as SUPPORTED_TYPES
from models.architectures import (ARCHITECTURES, ATTN_TEMPERATURE_ARCHS, EXPERT_TENSORS, KNOWN_LAYER_TENSORS,
                                  KNOWN_TENSORS, LONGROPE_ARCHS, LONGROPE_TENSORS, MOE_ARCHS, ROPE_SCALING_TYPES)
from models.errors import BadInputError, env_choice
GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> struct format (8 = string, 9 = array are handled apart)
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class _Truncated(Exception):
    pass


class _Cursor:
    """Bounds-checked little-endian reads from the memory-mapped file."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def strings(self, n: int) -> list[str]:
        """n length-prefixed strings: the vocabulary and merges, ~300k of them, so a tight loop."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack_len = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(n):
            if pos + 8 > size:
                raise _Truncated
            (length,) = unpack_len(buf, pos)
            pos += 8
            end = pos + length
            if end > size:
                raise _Truncated
            append(buf[pos:end].decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in SCALAR_FORMATS:
            return self.unpack(SCALAR_FORMATS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if n > self.size:                      # cannot be real: each item takes at least one byte
                raise _Truncated
            if itype in NUMPY_TYPES:
                dtype = np.dtype(NUMPY_TYPES[itype])
                start = self.take(n * dtype.itemsize)
                return np.frombuffer(self.buf, dtype=dtype, count=n, offset=start).tolist()
            if itype == STRING:
                return self.strings(n)
            return [self.value(itype) for _ in range(n)]
        raise BadInputError(f"unknown GGUF metadata type {vtype}")


WEIGHTS_ENV = "KVCHAT_WEIGHTS"
WEIGHTS_CHOICES = ("auto", "memory", "mapped")
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MEMINFO = Path("/proc/meminfo")


def weights_in_memory(n_bytes: int = 0) -> bool:
    """Do the kernels read a model's weights (n_bytes of them) from the process's own memory
    ("memory") or from mappings of their files ("mapped")? Decode reads every weight once per token,
    and a file mapping has 4 KB pages: on the Intel Xeon of the README a token's matmuls streamed 8%
    faster from memory, on the huge pages numpy asks Linux for (README: measured). A mapping costs
    no load time and is shared by every process that maps the file, and its pages can be dropped
    under memory pressure; a copy is the process's own. "auto": memory where the kernel hands out
    transparent huge pages (its setting is `always` or `madvise`) and the weights take at most half
    of the memory available now, mapped elsewhere. KVCHAT_WEIGHTS=memory|mapped forces it."""
    choice = env_choice(WEIGHTS_ENV, WEIGHTS_CHOICES, "auto")
    if choice != "auto":
        return choice == "memory"
    try:
        if "[never]" in THP_SETTING.read_text():
            return False
        available = next(int(line.split()[1]) << 10 for line in MEMINFO.read_text().splitlines()
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):   # not Linux, or no THP: nothing to gain
        return False
    return n_bytes <= available // 2


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
    """A validated GGUF model file. `reader.tensors` lists the memory-mapped tensors the way
    gguf.GGUFReader does (name, tensor_type, shape, data...); `get` reads metadata."""

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
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            st = os.fstat(f.fileno())
            self._identity = (st.st_ino, st.st_dev)
        try:
            self.fields, raw_tensors, data_start = self._parse_header(_Cursor(self._mmap, self.file_size))
        except (_Truncated, struct.error):
            raise BadInputError(f"corrupt or truncated GGUF file {self.path.name}: "
                                "the header runs past the end of the file") from None
        except UnicodeDecodeError:
            raise BadInputError(f"corrupt GGUF file {self.path.name}: bad text in the header") from None
        self.tensors = self._validate_tensors(raw_tensors, data_start)
        self.reader = SimpleNamespace(tensors=[self._reader_tensor(t) for t in self.tensors.values()])
        self.arch = self.get("general.architecture")
        if self.arch is None:
            raise BadInputError(f"GGUF file {self.path.name} has no general.architecture")

    def _parse_header(self, cur: _Cursor):
        cur.take(4)                                             # magic, checked already
        version = cur.unpack("<I")
        if version > 255:      # no such version was ever made: the header is damaged
            raise BadInputError(f"corrupt GGUF file {self.path.name}: its version field reads {version}")
        if version not in (2, 3):
            raise BadInputError(f"unsupported GGUF version {version} in {self.path.name} (kvchat reads 2 and 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        if n_tensors > self.file_size or n_kv > self.file_size:
            raise _Truncated
        fields = {}
        for _ in range(n_kv):
            key = cur.string()
            fields[key] = cur.value(cur.unpack("<I"))
        raw_tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 8:
                raise BadInputError(f"corrupt GGUF file {self.path.name}: tensor {name} has {n_dims} dimensions")
            dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
            raw_tensors.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise BadInputError(f"corrupt GGUF file {self.path.name}: bad alignment {alignment!r}")
        data_start = -(-cur.pos // alignment) * alignment
        return fields, raw_tensors, data_start

    def _validate_tensors(self, raw_tensors, data_start: int) -> dict[str, TensorInfo]:
        tensors = {}
        for name, shape, ggml_type, rel_offset in raw_tensors:
            if name in tensors:
                raise BadInputError(f"corrupt GGUF file {self.path.name}: tensor {name} appears twice")
            try:
                block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (KeyError, ValueError):
                raise BadInputError(f"tensor {name} has unknown ggml type {ggml_type}") from None
            n_elements = int(np.prod(shape, dtype=np.uint64)) if shape else 1
            if shape and shape[0] % block_elems:
                raise BadInputError(f"corrupt GGUF file {self.path.name}: tensor {name} rows are not whole blocks")
            n_bytes = n_elements // block_elems * block_bytes
            offset = data_start + rel_offset
            if offset + n_bytes > self.file_size:
                raise BadInputError(f"tensor {name} points past the end of the file "
                                    f"({offset + n_bytes} > {self.file_size} bytes): the file is truncated or corrupt")
            tensors[name] = TensorInfo(name, ggml_type, shape, n_elements, n_bytes, offset)
        return tensors

    def _reader_tensor(self, t: TensorInfo) -> SimpleNamespace:
        """A tensor as gguf.GGUFReader presents it (same dtype and shape of .data)."""
        np_dims = tuple(reversed(t.shape))
        typed = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(t.ggml_type)
        raw = np.frombuffer(self._mmap, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        if typed is not None:
            data = raw.view(typed).reshape(np_dims)
        else:
            block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
            data = raw.reshape(*np_dims[:-1], np_dims[-1] // block_elems * block_bytes)
        return SimpleNamespace(name=t.name, tensor_type=GGMLQuantizationType(t.ggml_type), shape=np.array(t.shape),
                               n_elements=t.n_elements, n_bytes=t.n_bytes, data_offset=t.offset, data=data)

    def resident(self, name: str) -> np.ndarray:
        """Tensor `name`'s data (as reader.tensors has it) read into this process's own memory
        (weights_in_memory says why). It is read from the file, not copied from the mapping, so the
        mapping's pages never join the RSS, and only from the file this object mapped: where the
        path is gone or names another file now, it is copied from the mapping."""
        t = self.tensors[name]
        view = self._reader_tensor(t).data
        buf = np.empty(t.n_bytes, np.uint8)
        try:
            with open(self.path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if (st.st_ino, st.st_dev) != self._identity:
                    return np.array(view)
                f.seek(t.offset)
                got = 0
                while got < t.n_bytes:
                    n = f.readinto(memoryview(buf)[got:])
                    if not n:
                        raise BadInputError(f"{self.path.name} was truncated while it was being loaded")
                    got += n
        except OSError:
            return np.array(view)
        return buf.view(view.dtype).reshape(view.shape)

    # --- metadata --------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python object (str, int, float, bool or list), or `default`."""
        return self.fields.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """`{arch}.{suffix}`, e.g. arch_get('context_length')."""
        return self.get(f"{self.arch}.{suffix}", default)

    @cached_property
    def chat_template(self) -> str | None:
        return self.get("tokenizer.chat_template")

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    def token_share(self, name: str) -> float:
        """The share of tensor `name` one token reads: a mixture of experts' expert tensors
        expert_used_count / expert_count, every other tensor all of it."""
        used = self.arch_get("expert_used_count")
        if not (self.n_expert and isinstance(used, int) and name.endswith("_exps.weight")):
            return 1.0
        return min(used, self.n_expert) / self.n_expert

    @property
    def n_active_params(self) -> int:
        """The parameters one token reads."""
        return int(sum(t.n_elements * self.token_share(name) for name, t in self.tensors.items()))

    @property
    def type_counts(self) -> Counter:
        return Counter(t.type_name for t in self.tensors.values())

    # --- checks the engines need -----------------------------------------------------------
    def unsupported(self, cpu: bool = True, n_ctx: int | None = None) -> str | None:
        """What of this file kvchat's own engines do not run ("architecture 'phi2'", "tensor type
        TQ2_0"), or None when they run all of it. (llama.cpp may still run it: --backend auto.)
        cpu: the CPU engine's, which runs every matrix on an exact kernel (kernels.cpu.qdot).
        n_ctx: the context it would run with (mistral3's attention temperature depends on it)."""
        if self.arch not in ARCHITECTURES:
            return f"architecture '{self.arch}'"
        scaling = self.arch_get("rope.scaling.type") or "none"
        if scaling not in ROPE_SCALING_TYPES:
            return f"rope scaling '{scaling}'"
        if self.arch not in LONGROPE_ARCHS and any(name in self.tensors for name in LONGROPE_TENSORS):
            return "LongRoPE rope scaling"
        if self.arch_get("deepstack_mapping") is not None:     # Granite Vision's image features in the layers
            return "deepstack layers"
        floor = self.attn_temperature_floor
        if floor is not None and n_ctx is not None and n_ctx > floor:
            return f"attention temperature scaling past {floor} tokens of context (--ctx {floor} runs it)"
        value_len, n_head = self.arch_get("attention.value_length"), self.arch_get("attention.head_count")
        if isinstance(value_len, int) and isinstance(n_head, int) and n_head > 0:   # (the engines' K and V heads are one size)
            key_len = self.arch_get("attention.key_length") or int(self.arch_get("embedding_length") or 0) // n_head
            if value_len != key_len:
                return f"key heads of {key_len} and value heads of {value_len}"
        layer_tensors = KNOWN_LAYER_TENSORS | (EXPERT_TENSORS if self.n_expert else frozenset())
        unknown = next((name for name in self.tensors if name not in KNOWN_TENSORS and not (
            name.startswith("blk.") and name.split(".", 2)[-1] in layer_tensors)), None)
        if unknown is not None:
            return f"tensor {unknown}"
        experts = self.experts_unsupported()
        if experts is not None:
            return experts
        bad = sorted({t.type_name for t in self.tensors.values() if t.ggml_type not in SUPPORTED_TYPES})
        if bad:
            return f"tensor type{'s' if len(bad) > 1 else ''} {', '.join(bad)}"
        return self._cpu_unsupported() if cpu else None

    @property
    def n_expert(self) -> int:
        """The experts of a mixture-of-experts file of an architecture whose layers llama.cpp runs as
        one (models.architectures.MOE_ARCHS), else 0."""
        n = self.arch_get("expert_count")
        return n if self.arch in MOE_ARCHS and isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0

    def experts_unsupported(self) -> str | None:
        """What of a mixture of experts' layers the engines do not run: llama.cpp's per-layer expert
        counts, and experts without gate matrices (llama.cpp then activates the up projection alone)."""
        if not self.n_expert:
            return None
        if not isinstance(self.arch_get("expert_used_count"), int) or isinstance(self.arch_get("expert_used_count"), bool):
            return "mixture-of-experts layers without one expert_used_count"
        if any(name.endswith("ffn_up_exps.weight") and name.replace("_up_", "_gate_") not in self.tensors
               for name in self.tensors):
            return "experts without gate matrices"
        return None

    def _cpu_unsupported(self) -> str | None:
        from kernels.cpu.qdot import has_exact_kernel
        from kernels.cpu.simd import HAS_AVX2
        if not HAS_AVX2:
            return "this CPU (its kernels need AVX2)"
        tied = "output.weight" not in self.tensors
        for name, t in self.tensors.items():        # the embedding only gathers rows, unless it is the output
            if len(t.shape) in (2, 3) and (tied or name != "token_embd.weight") and \
                    not has_exact_kernel(t.ggml_type, t.shape[1], t.shape[0]):
                return f"{t.type_name} matrices of {t.shape[1]} rows ({name})"
        return None

    @property
    def attn_temperature_floor(self) -> int | None:
        """mistral3's attention temperature (Llama 4's): llama.cpp multiplies Q at position p by
        1 + scale * ln(floor(p / F) + 1), F the YaRN original context; below F that is exactly 1, and
        kvchat's engines run such a file only with a context of at most F tokens. None: no such scaling."""
        if self.arch not in ATTN_TEMPERATURE_ARCHS or not self.arch_get("attention.temperature_scale"):
            return None
        return int(self.arch_get("rope.scaling.original_context_length") or self.arch_get("context_length") or 0)

    def require_supported(self, cpu: bool = True, n_ctx: int | None = None) -> "GGUFFile":
        """Refuse architectures and tensor types kvchat's engines cannot run."""
        reason = self.unsupported(cpu, n_ctx)
        if reason is not None:
            known = f" (it runs {', '.join(ARCHITECTURES)})" if reason.startswith("architecture") else ""
            raise BadInputError(f"kvchat's engine does not run {reason} in {self.path.name}{known}; "
                                "--backend llama.cpp (or auto) may")
        return self

    def info(self) -> dict:
        """What `kvchat models info` prints."""
        return {
            "path": str(self.path),
            "architecture": self.arch,
            "name": self.get("general.name"),
            "parameters": self.n_params,
            "experts": [self.n_expert, self.arch_get("expert_used_count")] if self.n_expert else None,
            "active_parameters": self.n_active_params,
            "tensor_types": dict(sorted(self.type_counts.items())),
            "context_length": self.arch_get("context_length"),
            "chat_template": self.chat_template is not None,
            "file_size": self.file_size,
            "kvchat_engine_lacks": self.unsupported(),
            "torch_engine_lacks": self.unsupported(cpu=False),
            "torch_dequantized": self.torch_dequantized(),
        }

    def torch_dequantized(self) -> list[str]:
        """The quantized matrix types the torch engine cannot read in place (no Triton GEMV kernel):
        it dequantizes them at load, and decode reads the float copy."""
        from kernels.cuda import GEMV_TYPES
        return sorted({t.type_name for t in self.tensors.values()
                       if len(t.shape) > 1 and t.ggml_type not in GEMV_TYPES and t.type_name not in ("F32", "F16", "BF16")})


def open_model(path: str | Path) -> GGUFFile:
    """Open and validate a GGUF file (its header, metadata and tensor table): what any engine needs.
    Whether kvchat's own engines run it is GGUFFile.unsupported / require_supported."""
    return GGUFFile(path)
