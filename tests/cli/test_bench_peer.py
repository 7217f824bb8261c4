"""The llama.cpp peer of `kvchat bench` (app/peer.py): llama-cpp-python built with every SIMD extension
this CPU reports, in a process of its own, beside the x86-64-v3 oracle the bit-exact tests use."""
from __future__ import annotations

import json

import llama_cpp
import pytest

from app.peer import cmake_args, cpu_flags, peer_dir
from tests.conftest import run_kvchat
from tests.engine.conftest import write_tiny_model


def test_the_peer_build_takes_every_extension_the_cpu_reports():
    args = cmake_args({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni"})
    for on in ("GGML_AVX2", "GGML_FMA", "GGML_AVX512", "GGML_AVX512_VNNI"):
        assert f"-D{on}=ON" in args
    for off in ("GGML_NATIVE", "GGML_AVX512_BF16", "GGML_AVX_VNNI", "GGML_AMX_TILE", "GGML_AMX_INT8"):
        assert f"-D{off}=OFF" in args
    assert "peer" in peer_dir().name and peer_dir().name.startswith("llama-cpp-python-")


@pytest.mark.real_model          # builds the peer once (minutes; then cached in the user cache dir)
def test_bench_runs_native_against_the_peer(tmp_path):
    """The default comparison: native against the peer, each row from the same rounds; the peer's own
    process reports this CPU's extensions, while this process keeps the AVX2 oracle."""
    path = write_tiny_model(tmp_path / "llama-q8.gguf", "llama", "Q8_0")
    out = run_kvchat("bench", "-m", str(path), "--backend", "native,llama.cpp-peer", "-p", "16", "-n", "4", "-r", "1",
                     "--json")
    err = out.stderr.decode()
    assert out.returncode == 0, err
    rows = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert {(r["backend"], r["test"]) for r in rows} == {(b, t) for b in ("native", "llama.cpp-peer")
                                                         for t in ("pp16", "tg4", "ttft")}
    assert all(r["t_s_mean"] > 0 and r["device"] == "cpu" for r in rows)
    for r in (r for r in rows if r["test"] == "tg4"):     # decode against the read probe of the same rounds
        assert r["now_gb_s"] > 0 and r["pct_of_now"] == pytest.approx(100 * r["gb_s"] / r["now_gb_s"], abs=0.2)
    assert "round 1/1 read probe:" in err
    built = next(line for line in err.splitlines() if line.startswith("llama.cpp-peer: llama.cpp built with"))
    assert ("AVX512" in built) == ("avx512f" in cpu_flags())
    assert "AVX512 = 1" not in llama_cpp.llama_print_system_info().decode()    # the oracle, in this process
    with_batch = run_kvchat("bench", "-m", str(path), "--backend", "llama.cpp-peer", "--batch", "2")
    assert with_batch.returncode == 2 and "pp/tg/TTFT" in with_batch.stderr.decode()
