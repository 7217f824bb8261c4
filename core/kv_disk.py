"""The KV cache on disk: full KV blocks that outlive the process, so a reopened chat or a repeated
long prompt restores its prefix instead of computing it again.

A block is addressed by a chained key, as the in-memory prefix map is (core.kv_cache), but one that
names everything that decides its bits:

    seed  = blake2b(model file's SHA-256, arithmetic, shape)
    key_i = blake2b(key_{i-1}, the block's token ids)         (key_-1 = seed)

`arithmetic` names the computation (engine, instruction set or GPU, KV dtype): a block written by
another engine, ISA variant or model is never found, and one that claims to be (a damaged or foreign
file) fails the header check.

One file per block, `<root>/<key[:2]>/<key>.kvb`:

    header   magic, version, model SHA-256, arithmetic (32 bytes), shape (n_layer, block_size,
             n_kv_heads, head_dim), the parent key, the block's token ids (block_size int32)
    payload  K then V: (n_layer, block_size, n_kv_heads, head_dim) float16 each
    trailer  CRC-32 of header and payload (it catches a flipped bit or a torn write; the header
             fields are compared one by one)

Writes go to a temporary file in the same folder and are renamed into place, so two processes
writing the same block never leave a torn file (the rename is atomic; the loser's identical copy
replaces the winner's). Reads map the file and copy the payload into the paged cache. A file that
fails any check is deleted and its tokens are computed again; a folder that cannot be written turns
the disk cache off with one warning and never fails a run.

The folder is kept under a size cap by deleting the least recently used blocks (a restore touches
its file's mtime).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from core.kv_cache import OutOfBlocks
from core.paths import cache_dir, data_dir
from models.errors import BadInputError, env_choice

if TYPE_CHECKING:
    from core.kv_cache import PagedKVCache, Sequence as KVSequence

MAGIC = b"KVCHATKV"
VERSION = 1
SUFFIX = ".kvb"
DEFAULT_MAX_BYTES = 4 << 30
ENV_DIR, ENV_ON, ENV_MAX = "KVCHAT_KV_DIR", "KVCHAT_KV_DISK", "KVCHAT_KV_DISK_MAX"
_HEADER = struct.Struct("<8sI32s32s4I32s")     # magic, version, model sha, arithmetic, shape, parent key
_CHECK = 4                                     # bytes of the CRC-32 trailer


def kv_dir() -> Path:
    """Where the blocks live (KVCHAT_KV_DIR overrides; default: the user cache dir's kv/)."""
    return Path(os.environ.get(ENV_DIR) or cache_dir() / "kv")


def enabled_by_default() -> bool:
    """Whether the disk cache is on where no flag says: KVCHAT_KV_DISK=on|off, else (unset, or
    auto) the setting (`kvchat cache on|off`), else on."""
    choice = env_choice(ENV_ON, ("auto", "on", "off"), "auto")
    if choice == "auto":
        return bool(_settings().get("kv_disk", True))
    return choice == "on"


def parse_size(text: str) -> int:
    """'4G', '500M', '1.5GB', '123456' -> bytes (powers of 1024). ValueError if malformed."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    number = float(t[:-1] if scale > 1 else t)
    if not number >= 0 or number == float("inf"):
        raise ValueError(text)
    return int(number * scale)


def default_max_bytes() -> int:
    """The size cap where no flag says: KVCHAT_KV_DISK_MAX, else the setting (`kvchat cache max
    SIZE`), else DEFAULT_MAX_BYTES."""
    raw = os.environ.get(ENV_MAX)
    if raw:
        try:
            return parse_size(raw)
        except ValueError:
            raise BadInputError(f"{ENV_MAX} wants a size such as 4G or 500M, got {raw!r}") from None
    value = _settings().get("kv_disk_max")
    return value if isinstance(value, int) and value >= 0 else DEFAULT_MAX_BYTES


def _settings_path() -> Path:
    return data_dir() / "settings.json"


def _settings() -> dict:
    """The user's kvchat settings (one JSON object; unreadable or malformed reads as none)."""
    try:
        value = json.loads(_settings_path().read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def save_setting(**values) -> None:
    """Set kv_disk (bool) and/or kv_disk_max (bytes) in the settings file (atomically)."""
    path = _settings_path()
    merged = _settings() | values
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=2) + "\n")
    os.replace(tmp, path)


def file_sha256(path: Path) -> bytes:
    """The model file's SHA-256, computed once per (file, size, mtime) and remembered in the kv folder."""
    st = path.stat()
    memo = kv_dir() / "models" / f"{path.name}-{st.st_size}-{st.st_mtime_ns}.sha256"
    try:
        digest = bytes.fromhex(memo.read_text().strip())
        if len(digest) == 32:
            return digest
    except (OSError, ValueError):
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").digest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest.hex())
    except OSError:
        pass
    return digest


@dataclass(frozen=True)
class BlockFormat:
    """What every block of one model under one arithmetic looks like: it seeds the key chain and is
    checked against each file's header."""
    model_sha256: bytes                 # 32 bytes
    arithmetic: str                     # e.g. "native/native/f16", "torch/NVIDIA H100/f16"
    shape: tuple[int, int, int, int]    # (n_layer, block_size, n_kv_heads, head_dim)

    @property
    def arith_bytes(self) -> bytes:
        raw = self.arithmetic.encode()
        return raw + b"\0" * (32 - len(raw)) if len(raw) <= 32 else hashlib.blake2b(raw, digest_size=32).digest()

    @property
    def block_size(self) -> int:
        return self.shape[1]

    @property
    def half_bytes(self) -> int:        # K (or V) of one block, all layers
        n_layer, bs, h, d = self.shape
        return n_layer * bs * h * d * 2

    @property
    def file_bytes(self) -> int:
        return _HEADER.size + 4 * self.block_size + 2 * self.half_bytes + _CHECK

    def seed(self) -> bytes:
        return hashlib.blake2b(self.model_sha256 + self.arith_bytes + struct.pack("<4I", *self.shape),
                               digest_size=32).digest()

    def keys(self, ids: Sequence[int], n_blocks: int) -> list[bytes]:
        """The chained key of each of the first n_blocks full blocks of ids."""
        bs, key, out = self.block_size, self.seed(), []
        for i in range(n_blocks):
            key = hashlib.blake2b(key + np.asarray(ids[i * bs:(i + 1) * bs], "<i4").tobytes(), digest_size=32).digest()
            out.append(key)
        return out


class DiskKV:
    """The block files of one model and arithmetic: find, load (validated), save, evict."""

    def __init__(self, fmt: BlockFormat, root: Path | None = None, max_bytes: int | None = None,
                 warn: Callable[[str], None] | None = None):
        self.fmt = fmt
        self.root = Path(root) if root else kv_dir()
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.warn = warn or (lambda line: print(f"kvchat: {line}", file=sys.stderr))
        self.off_reason: str | None = None     # set when the folder failed us: the cache is off
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._turn_off(e)

    @property
    def on(self) -> bool:
        return self.off_reason is None

    def _turn_off(self, e: OSError) -> None:
        self.off_reason = f"the disk KV cache is off ({e.strerror or e} in {self.root})"
        self.warn(self.off_reason)

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

    # --- reading ------------------------------------------------------------------------------
    def load(self, key: bytes, parent: bytes, tokens: Sequence[int],
             into: Callable[[np.ndarray, np.ndarray], None]) -> bool:
        """Hand the K and V of block `key` (whose parent key and token ids the caller knows) to
        into(k, v), each (n_layer, block_size, n_kv_heads, head_dim) float16 read straight from the
        mapped file (valid only during the call). False: no such file, or one that fails a check
        (then it is deleted)."""
        if not self.on:
            return False
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != self.fmt.file_bytes:
                    raise _Bad("size")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            return False
        except (_Bad, OSError, ValueError):
            _unlink(path)
            return False
        try:
            if not self._valid(mm, parent, tokens):
                _unlink(path)
                return False
            fmt = self.fmt
            start, n = _HEADER.size + 4 * fmt.block_size, fmt.half_bytes // 2
            k = np.frombuffer(mm, np.float16, n, start).reshape(fmt.shape)
            v = np.frombuffer(mm, np.float16, n, start + fmt.half_bytes).reshape(fmt.shape)
            try:
                into(k, v)
            finally:
                del k, v                        # (the map closes only when no array points into it)
        finally:
            mm.close()
        _touch(path)                            # recently used: eviction takes it last
        return True

    def _valid(self, mm: mmap.mmap, parent: bytes, tokens: Sequence[int]) -> bool:
        """The header names this model, arithmetic, shape, parent key and token ids; the checksum holds."""
        fmt = self.fmt
        magic, version, sha, arith, *rest = _HEADER.unpack(mm[:_HEADER.size])
        if (magic, version, sha, arith, tuple(rest[:4]), rest[4]) != \
                (MAGIC, VERSION, fmt.model_sha256, fmt.arith_bytes, fmt.shape, parent):
            return False
        if mm[_HEADER.size:_HEADER.size + 4 * fmt.block_size] != np.asarray(tokens, "<i4").tobytes():
            return False
        with memoryview(mm) as view, view[:-_CHECK] as body:
            check = zlib.crc32(body)
        return struct.pack("<I", check) == mm[-_CHECK:]

    def has(self, key: bytes) -> bool:
        return self.on and self.path(key).exists()

    # --- writing ------------------------------------------------------------------------------
    def save(self, key: bytes, parent: bytes, tokens: Sequence[int], k: np.ndarray, v: np.ndarray) -> bool:
        """Write one block (k, v: (n_layer, block_size, n_kv_heads, head_dim) float16) unless it is
        on disk already. Returns whether a file was written. A failure turns the cache off."""
        if not self.on or self.has(key):
            return False
        fmt = self.fmt
        header = _HEADER.pack(MAGIC, VERSION, fmt.model_sha256, fmt.arith_bytes, *fmt.shape, parent)
        parts = [header, np.asarray(tokens, "<i4").tobytes(),
                 np.ascontiguousarray(k, np.float16).tobytes(), np.ascontiguousarray(v, np.float16).tobytes()]
        check = 0
        for p in parts:
            check = zlib.crc32(p, check)
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
                f.write(struct.pack("<I", check))
            os.replace(tmp, path)
            return True
        except OSError as e:
            _unlink(tmp)
            self._turn_off(e)
            return False

    # --- with a paged cache -------------------------------------------------------------------
    def persist(self, cache: "PagedKVCache", seq: "KVSequence") -> int:
        """Save seq's full blocks that are not on disk yet (touching those that are), then keep the
        folder under its cap. Returns how many blocks were written."""
        bs = self.fmt.block_size
        tokens = seq.tokens
        keys = self.fmt.keys(tokens, len(tokens) // bs)
        written = 0
        for i, key in enumerate(keys):
            if not self.on:
                break
            if self.has(key):
                _touch(self.path(key))
                continue
            k, v = cache.read_block(seq.blocks[i])
            written += self.save(key, keys[i - 1] if i else self.fmt.seed(), tokens[i * bs:(i + 1) * bs], k, v)
        if written:
            self.evict()
        return written

    # --- the folder ---------------------------------------------------------------------------
    def evict(self) -> int:
        """Delete least recently used blocks until the folder is under max_bytes. Returns how many."""
        return evict(self.root, self.max_bytes)


def restorer(disk: DiskKV, cache: "PagedKVCache", ids: Sequence[int]) -> Callable[[int], int | None]:
    """Sequence.reuse_prefix's `restore` for one prompt: full block i of ids from disk into a fresh
    block of the cache's pool, or None (not on disk, damaged, or no free block)."""
    bs = disk.fmt.block_size
    keys: list[bytes] = []

    def restore(i: int) -> int | None:
        if not keys:
            keys.extend(disk.fmt.keys(ids, len(ids) // bs))
        if i >= len(keys) or not disk.has(keys[i]):
            return None
        try:
            b = cache.pool.allocate()
        except OutOfBlocks:
            return None
        if not disk.load(keys[i], keys[i - 1] if i else disk.fmt.seed(), ids[i * bs:(i + 1) * bs],
                         lambda k, v: cache.write_block(b, k, v)):
            cache.pool.decref(b)
            return None
        return b

    return restore


class _Bad(Exception):
    """A block file that fails a check."""


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def block_files(root: Path) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of every block file under root (another process may delete some meanwhile)."""
    out = []
    try:
        subdirs = [d for d in os.scandir(root) if d.is_dir() and len(d.name) == 2]
    except OSError:
        return out
    for d in subdirs:
        try:
            for e in os.scandir(d.path):
                if e.name.endswith(SUFFIX):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    out.append((st.st_mtime, st.st_size, Path(e.path)))
        except OSError:
            continue
    return out


def evict(root: Path, max_bytes: int) -> int:
    files = block_files(root)
    total = sum(size for _, size, _ in files)
    removed = 0
    for _, size, path in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        _unlink(path)
        total -= size
        removed += 1
    return removed


def stats(root: Path | None = None) -> dict:
    root = root or kv_dir()
    files = block_files(root)
    return {"dir": str(root), "blocks": len(files), "bytes": sum(size for _, size, _ in files),
            "max_bytes": default_max_bytes()}


def clear(root: Path | None = None) -> int:
    """Delete every block file; returns how many."""
    files = block_files(root or kv_dir())
    for _, _, path in files:
        _unlink(path)
    return len(files)
