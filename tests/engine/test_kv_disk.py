"""The KV cache on disk (core.kv_disk): restored blocks give the bits the blocks in memory give, on
every engine; a damaged, foreign or misplaced block file is never used; a folder that fails turns
the cache off without failing the run; the folder stays under its cap, least recently used first."""
from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

from core import kv_disk
from core.kv_cache import PagedKVCache
from core.kv_disk import BlockFormat, DiskKV
from core.native_backend import NativeBackend
from core.torch_backend import TorchBackend
from models.errors import BadInputError
from tests.conftest import run_kvchat

BS = 16
PROMPT = [1] + [int(t) for t in np.random.default_rng(7).integers(3, 320, 47)]   # 48 tokens: 3 blocks
NEXT = [int(t) for t in np.random.default_rng(8).integers(3, 320, 21)]
SHAPE = (2, BS, 2, 64)


@pytest.fixture
def kv_root(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    monkeypatch.setenv("KVCHAT_KV_DIR", str(root))
    return root


def make_backend(tiny_model, engine: str):
    g, tok = tiny_model("qwen2", "Q4_K")
    backend = NativeBackend(g, tok, 128) if engine == "native" else TorchBackend(g, tok, 128, "cpu")
    backend.attach_disk(g.path)
    return backend


def greedy(backend, first_logits, n: int) -> list[int]:
    out, logits = [], first_logits
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = backend.extend([out[-1]])
    return out


def turn_one(backend) -> list[int]:
    """The prompt, then 16 greedy tokens: 64 tokens, four full blocks (one computed by decoding),
    saved to disk. Returns the tokens in the cache."""
    assert backend.reuse_prefix(PROMPT) == 0
    greedy(backend, backend.extend(PROMPT), 16)
    assert backend.seq.n_tokens == 64
    assert backend.persist() == 4 and backend.persist() == 0       # written once
    return list(backend.seq.tokens)


@pytest.mark.parametrize("engine", ["native", "torch"])
def test_a_turn_after_a_restore_from_disk_has_the_bits_of_the_blocks_in_memory(tiny_model, kv_root, engine):
    first = make_backend(tiny_model, engine)
    history = turn_one(first)
    turn2 = history + NEXT
    # the next turn with the blocks still in memory
    assert first.reuse_prefix(turn2) == 64 and first.stats.cache_disk_n == 0
    in_memory = first.extend(NEXT)
    tokens_mem = greedy(first, in_memory, 6)
    # the same turn in a new engine (a new process's): memory is empty, the disk has the blocks
    second = make_backend(tiny_model, engine)
    assert second.reuse_prefix(turn2) == 64 and second.stats.cache_disk_n == 64
    restored = second.extend(NEXT)
    assert np.array_equal(restored, in_memory)
    assert greedy(second, restored, 6) == tokens_mem
    # in-memory reuse comes first: the disk fills only what memory does not hold
    assert second.reuse_prefix(turn2) == len(turn2) - 1 and second.stats.cache_disk_n == 0


def test_batch_loads_a_shared_prefix_from_disk_once_and_saves_each_request(tiny_model, kv_root):
    from core.batch import BatchRequest, BatchScheduler
    from core.types import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=4)
    turn_one(make_backend(tiny_model, "native"))             # PROMPT's three blocks are on disk
    backend = make_backend(tiny_model, "native")
    tails = [[5 + i] * 20 for i in range(3)]
    results = list(BatchScheduler(backend, parallel=3).results(
        BatchRequest(i, PROMPT + tail, params) for i, tail in enumerate(tails)))
    assert sorted(r.timings.cache_disk_n for r in results) == [0, 0, 48]    # loaded once, then shared in memory
    assert all(r.timings.cache_n == 48 for r in results)
    fmt = backend.disk.fmt
    for tail in tails:                                   # each request's own blocks are saved
        assert all(backend.disk.has(k) for k in fmt.keys(PROMPT + tail, 4))


def test_a_block_from_another_model_or_arithmetic_is_never_found(tiny_model, kv_root):
    turn_one(make_backend(tiny_model, "native"))
    fmt = make_backend(tiny_model, "native").disk.fmt
    keys = fmt.keys(PROMPT, 3)
    assert all(DiskKV(fmt).has(k) for k in keys)
    for other in (BlockFormat(bytes(32), fmt.arithmetic, fmt.shape),          # another model file
                  BlockFormat(fmt.model_sha256, "torch/cpu/f16", fmt.shape),   # another engine
                  BlockFormat(fmt.model_sha256, "native/avx2/f16", fmt.shape) if fmt.arithmetic != "native/avx2/f16"
                  else BlockFormat(fmt.model_sha256, "native/native/f16", fmt.shape)):
        assert not any(DiskKV(other).has(k) for k in other.keys(PROMPT, 3))


def _blocks(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(SHAPE).astype(np.float16), rng.standard_normal(SHAPE).astype(np.float16))
            for _ in range(n)]


def _saved(root, n: int = 3) -> tuple[DiskKV, list[bytes], list[tuple[np.ndarray, np.ndarray]]]:
    disk = DiskKV(BlockFormat(b"m" * 32, "test/cpu/f16", SHAPE), root=root)
    keys = disk.fmt.keys(PROMPT, n)
    blocks = _blocks(n)
    for i, (k, v) in enumerate(blocks):
        assert disk.save(keys[i], keys[i - 1] if i else disk.fmt.seed(), PROMPT[i * BS:(i + 1) * BS], k, v)
    return disk, keys, blocks


def _load(disk, keys, i) -> tuple[np.ndarray, np.ndarray] | None:
    got = []
    found = disk.load(keys[i], keys[i - 1] if i else disk.fmt.seed(), PROMPT[i * BS:(i + 1) * BS],
                      lambda k, v: got.append((k.copy(), v.copy())))
    assert found == bool(got)
    return got[0] if got else None


def test_saved_blocks_load_back_exactly_and_a_second_save_writes_nothing(tmp_path):
    disk, keys, blocks = _saved(tmp_path)
    for i, (k, v) in enumerate(blocks):
        got = _load(disk, keys, i)
        assert np.array_equal(got[0], k) and np.array_equal(got[1], v)
    assert not disk.save(keys[0], disk.fmt.seed(), PROMPT[:BS], *blocks[0])
    assert kv_disk.stats(tmp_path)["blocks"] == 3


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _flip_payload_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _other_model_header(path):
    data = bytearray(path.read_bytes())
    data[12] ^= 0xFF                       # a byte of the model's SHA-256
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip_payload_byte, _other_model_header, "misplaced"])
def test_a_damaged_or_misplaced_block_file_is_never_used_and_is_deleted(tmp_path, damage):
    disk, keys, _ = _saved(tmp_path)
    path = disk.path(keys[1])
    if damage == "misplaced":                 # block 2's file under block 1's name: wrong parent and tokens
        path.write_bytes(disk.path(keys[2]).read_bytes())
    else:
        damage(path)
    assert _load(disk, keys, 1) is None
    assert not path.exists()
    assert _load(disk, keys, 0) is not None   # the others are untouched


def test_a_damaged_block_is_computed_again_with_the_same_bits(tiny_model, kv_root):
    history = turn_one(make_backend(tiny_model, "native"))
    cold = make_backend(tiny_model, "native")
    cold.attach_disk(None)
    assert cold.reuse_prefix(history + NEXT) == 0
    reference = cold.extend(history + NEXT)
    backend = make_backend(tiny_model, "native")
    _flip_payload_byte(backend.disk.path(backend.disk.fmt.keys(history, 4)[2]))
    # blocks 0 and 1 come from disk; block 2 fails its checksum: from there the prompt is computed
    assert backend.reuse_prefix(history + NEXT) == 32 and backend.stats.cache_disk_n == 32
    ours = backend.extend((history + NEXT)[32:])
    assert np.array_equal(ours, reference)


@pytest.mark.parametrize("folder", ["a file", "read-only"])
def test_a_cache_folder_that_cannot_be_written_turns_the_cache_off_and_the_run_goes_on(
        tiny_model, tmp_path, monkeypatch, folder):
    """A file where the folder should be, or a folder read-only for this process: without write
    permission, or, for root (whom permissions do not stop; CI runs as root), on a file system that
    takes no new entries (/proc)."""
    root = tmp_path / "kv"
    if folder == "a file":
        root.write_text("a file where the cache folder should be")
    elif os.geteuid() != 0:
        root.mkdir()
        root.chmod(0o500)
    else:
        root = Path("/proc/kvchat-kv")
    monkeypatch.setenv("KVCHAT_KV_DIR", str(root))
    warnings: list[str] = []
    g, tok = tiny_model("qwen2", "Q4_K")
    backend = NativeBackend(g, tok, 128)
    backend.attach_disk(g.path, warn=warnings.append)
    assert len(warnings) == 1 and "disk KV cache is off" in warnings[0]
    assert backend.reuse_prefix(PROMPT) == 0
    cold = backend.extend(PROMPT)
    assert backend.persist() == 0
    backend.reset()
    assert backend.reuse_prefix(PROMPT) == 0 and np.array_equal(backend.extend(PROMPT), cold)


def test_a_write_failure_mid_run_turns_the_cache_off_once(tmp_path):
    warnings: list[str] = []
    disk = DiskKV(BlockFormat(b"m" * 32, "test/cpu/f16", SHAPE), root=tmp_path, warn=warnings.append)
    keys = disk.fmt.keys(PROMPT, 2)
    disk.path(keys[0]).parent.parent.mkdir(exist_ok=True)
    disk.path(keys[0]).parent.write_text("not a folder")     # the block's subfolder cannot be made
    (k, v), = _blocks(1)
    assert not disk.save(keys[0], disk.fmt.seed(), PROMPT[:BS], k, v)
    assert not disk.on and len(warnings) == 1
    assert not disk.save(keys[1], keys[0], PROMPT[BS:2 * BS], k, v) and len(warnings) == 1
    assert [p.name for p in tmp_path.rglob("*.tmp")] == []


def test_eviction_keeps_the_folder_under_its_cap_least_recently_used_first(tmp_path):
    disk, keys, _ = _saved(tmp_path, 3)
    for age, key in zip((300, 200, 100), keys):               # block 0 oldest, block 2 newest
        os.utime(disk.path(key), (1e9 - age, 1e9 - age))
    assert _load(disk, keys, 0) is not None                   # a restore makes block 0 the newest
    size = disk.fmt.file_bytes
    assert kv_disk.evict(tmp_path, 2 * size) == 1
    assert [disk.has(k) for k in keys] == [True, False, True]
    assert kv_disk.evict(tmp_path, 0) == 2 and kv_disk.stats(tmp_path)["blocks"] == 0


def _write_many(root: str, n: int) -> None:
    disk = DiskKV(BlockFormat(b"m" * 32, "test/cpu/f16", SHAPE), root=root)
    disk.has = lambda key: False                    # write every time, over the other process's file
    key, = disk.fmt.keys(PROMPT, 1)
    (k, v), = _blocks(1)
    for _ in range(n):
        assert disk.save(key, disk.fmt.seed(), PROMPT[:BS], k, v)


def test_two_processes_writing_the_same_block_never_leave_a_torn_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_write_many, args=(str(tmp_path), 200)) for _ in range(2)]
    for w in workers:
        w.start()
    disk = DiskKV(BlockFormat(b"m" * 32, "test/cpu/f16", SHAPE), root=tmp_path)
    key, = disk.fmt.keys(PROMPT, 1)
    while any(w.is_alive() for w in workers):       # meanwhile, every read finds a whole block
        if disk.path(key).exists():
            got = _load(disk, [key], 0)
            assert got is not None and np.array_equal(got[0], _blocks(1)[0][0])
    for w in workers:
        w.join()
        assert w.exitcode == 0
    assert _load(disk, [key], 0) is not None
    assert list(tmp_path.rglob("*.tmp")) == []


def test_the_paged_cache_reads_and_writes_whole_blocks():
    cache = PagedKVCache(2, 2, 64, 64, BS)
    (k, v), = _blocks(1)
    cache.write_block(3, k, v)
    got_k, got_v = cache.read_block(3)
    assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
    assert not cache.read_block(2)[0].any()


def test_sizes_parse_as_people_write_them(monkeypatch):
    assert kv_disk.parse_size("4G") == 4 << 30 and kv_disk.parse_size("500M") == 500 << 20
    assert kv_disk.parse_size("1.5GiB") == 3 << 29 and kv_disk.parse_size("123") == 123
    for bad in ("", "x", "-1G", "inf"):
        with pytest.raises(ValueError):
            kv_disk.parse_size(bad)
    monkeypatch.setenv(kv_disk.ENV_MAX, "lots")
    with pytest.raises(BadInputError, match="KVCHAT_KV_DISK_MAX wants a size"):
        kv_disk.default_max_bytes()


# --- as a user runs it -----------------------------------------------------------------------
DOC = " ".join(f"Note {i}: the meeting about the garden moved to room {i % 7}." for i in range(40))


@pytest.mark.real_model
def test_run_twice_restores_the_prompt_from_disk_and_cache_commands_manage_it(qwen_path, tmp_path):
    env = {"KVCHAT_KV_DISK": "", "KVCHAT_KV_DIR": str(tmp_path / "kv"), "KVCHAT_DATA_DIR": str(tmp_path)}
    args = ["run", "--json", "--temperature", "0", "-n", "12"]

    def run(question: str, *extra: str) -> dict:
        out = run_kvchat(*args, *extra, DOC + "\n\n" + question, env=env)
        assert out.returncode == 0, out.stderr.decode()
        return json.loads(out.stdout)

    cold = run("Which room is note 12 in?")
    assert cold["timings"]["cache_disk_n"] == 0
    warm = run("Which room is note 12 in?")
    n_prompt = cold["timings"]["prompt_n"]
    assert warm["timings"]["cache_disk_n"] >= n_prompt - 16 - 1 and warm["timings"]["prompt_n"] <= 17
    assert warm["tokens"] == cold["tokens"]
    other = run("Which room is note 3 in?")                   # the document is prefilled once
    assert other["timings"]["cache_disk_n"] > n_prompt - 40
    off = run("Which room is note 12 in?", "--kv-disk", "off")
    assert off["timings"]["cache_disk_n"] == 0 and off["tokens"] == cold["tokens"]

    stats = run_kvchat("cache", "stats", env=env)
    assert stats.returncode == 0 and "on, " + str(tmp_path / "kv") in stats.stdout.decode()
    n_blocks = int(stats.stdout.decode().split("blocks")[1].split()[0].replace(",", ""))
    assert n_blocks >= n_prompt // 16
    assert run_kvchat("cache", "off", env=env).returncode == 0
    assert run("Which room is note 12 in?")["timings"]["cache_disk_n"] == 0      # the setting: off
    assert run("Which room is note 12 in?", "--kv-disk", "on")["timings"]["cache_disk_n"] > 0
    assert f"deleted {n_blocks}" in run_kvchat("cache", "clear", env=env).stdout.decode()
    bad = run_kvchat("cache", "max", "lots", env=env)
    assert bad.returncode == 2 and bad.stderr.decode().count("\n") == 1
