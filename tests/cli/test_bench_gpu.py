"""The GPU half of `kvchat bench`: GB/s against the card's peak memory bandwidth, and HF transformers
on the same GGUF as a peer of the torch engine. What needs a card runs only where there is one;
the arithmetic, the output, the CLI's error without CUDA and the transformers timing (on the CPU,
on a tiny GGUF) run everywhere."""
from __future__ import annotations

import json

import pytest
import torch

from app.bench import (
    card_bandwidth_gb_s,
    peak_bandwidth_gb_s,
    print_table,
    ratio_pairs,
    torch_weight_bytes_per_token,
    weight_bytes_per_token,
)
from models.gguf_file import open_model
from tests.conftest import run_kvchat
from tests.engine.conftest import write_tiny_model

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real GPU")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(arch, qtype) -> path of a tiny random-weight GGUF (tests/engine/conftest.py)."""
    folder, made = tmp_path_factory.mktemp("bench_gguf"), {}

    def make(arch: str, qtype: str):
        if (arch, qtype) not in made:
            made[arch, qtype] = write_tiny_model(folder / f"{arch}-{qtype}.gguf", arch, qtype)
        return made[arch, qtype]

    return make


@pytest.mark.parametrize("clock_khz, bus_bits, expected", [
    (2_619_000, 5120, 3352.3),   # H100 SXM5 80GB (HBM3), as torch reports it
    (1_593_000, 5120, 2039.0),   # A100 80GB SXM (HBM2e)
    (10_501_000, 384, 1008.1),   # RTX 4090 (GDDR6X, 21 Gbps effective)
])
def test_peak_bandwidth_arithmetic(clock_khz, bus_bits, expected):
    assert peak_bandwidth_gb_s(clock_khz, bus_bits) == pytest.approx(expected, abs=0.1)


def test_card_bandwidth_is_none_without_cuda():
    card = card_bandwidth_gb_s()
    assert (card is None) == (not torch.cuda.is_available())


def test_torch_engine_weight_bytes(tiny_gguf):
    """The torch engine reads Q8_0 (a GEMV type) as its GGUF blocks, Q4_0 (none) as a float16 copy."""
    q8 = open_model(tiny_gguf("llama", "Q8_0"))
    assert torch_weight_bytes_per_token(q8) == weight_bytes_per_token(q8)
    q4 = open_model(tiny_gguf("llama", "Q4_0"))
    matrices = [t for name, t in q4.tensors.items() if len(t.shape) > 1 and name != "token_embd.weight"]
    vectors = [t for t in q4.tensors.values() if len(t.shape) == 1]
    expected = sum(2 * int(torch.tensor(t.shape).prod()) for t in matrices) + sum(t.n_bytes for t in vectors)
    assert torch_weight_bytes_per_token(q4) == expected > weight_bytes_per_token(q4)


def test_ratio_pairs():
    assert ratio_pairs(["native", "llama.cpp", "torch", "transformers"]) == [
        ("native", "torch"), ("llama.cpp", "torch"), ("torch", "transformers")]
    assert ratio_pairs(["torch", "transformers"]) == [("torch", "transformers")]
    assert ratio_pairs(["native", "llama.cpp"]) == [("native", "llama.cpp")]
    assert ratio_pairs(["llama.cpp"]) == []


def test_table_shows_share_of_peak_and_torch_vs_transformers(capsys):
    def row(backend, test, t_s, **extra):
        return {"backend": backend, "test": test, "t_s_mean": t_s, "t_s_sd": 0.0, "gb_s": None, **extra}
    rows = [row("torch", "pp512", 20000.0), row("transformers", "pp512", 10000.0),
            row("torch", "tg128", 500.0, gb_s=200.0, tpot_ms=2.0, gpu="H100", peak_gb_s=3352.3, pct_of_peak=6.0),
            row("transformers", "tg128", 100.0, gb_s=99.0, tpot_ms=10.0, gpu="H100", peak_gb_s=3352.3,
                pct_of_peak=3.0),
            row("torch", "ttft", 20000.0, ms_mean=25.0, ms_sd=0.0), row("transformers", "ttft", 10000.0,
                                                                        ms_mean=50.0, ms_sd=0.0)]
    print_table(rows, ["torch", "transformers"], {"torch": 400_000_000, "transformers": 990_000_000})
    out = capsys.readouterr().out.splitlines()
    assert "% peak" in out[0]
    assert any(line.startswith("torch ") and "tg128" in line and line.endswith("6.0%") for line in out)
    for test, ratio in (("pp512", "2.00x"), ("tg128", "5.00x"), ("ttft", "2.00x")):
        assert f"torch vs transformers {test}: {ratio}" in out
    assert out[-1] == "(weights read per decoded token: torch 0.400 GB, transformers 0.990 GB)"


@pytest.mark.real_model   # drives kvchat in a subprocess
def test_bench_device_cuda_without_cuda_is_one_line_and_exit_2():
    """Checked before any model loads: the model named does not even exist. On a machine with a GPU,
    CUDA_VISIBLE_DEVICES= hides it."""
    out = run_kvchat("bench", "--device", "cuda", "-m", "/nonexistent/model.gguf", "-r", "1",
                     env={"CUDA_VISIBLE_DEVICES": ""})
    err = out.stderr.decode()
    assert out.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("kvchat: error: --device cuda")
    assert "Traceback" not in err and out.stdout == b""


@pytest.mark.parametrize("arch, qtype", [("llama", "Q8_0"), ("qwen2", "Q4_K"), ("gemma3", "Q8_0")])
def test_transformers_peer_times_the_same_gguf_on_cpu(tiny_gguf, arch, qtype):
    from app.bench_hf import load_transformers, time_transformers
    from app.bench_hf import weight_bytes_per_token as hf_bytes
    path = tiny_gguf(arch, qtype)
    model = load_transformers(path, "cpu")
    g = open_model(path)
    assert model.config.vocab_size == g.tensors["token_embd.weight"].shape[-1]
    assert next(model.parameters()).dtype == torch.float32
    # float32 parameters, the embedding table left out where untied (llama, qwen2), kept where tied (gemma3)
    n_params = sum(int(torch.tensor(t.shape).prod()) for t in g.tensors.values())
    embd = int(torch.tensor(g.tensors["token_embd.weight"].shape).prod())
    assert hf_bytes(model) == 4 * (n_params - (embd if "output.weight" in g.tensors else 0))
    prompt = list(range(3, 40))
    for context in (None, list(range(40, 60))):
        prompt_s, ttft_s, decode_s = time_transformers(model, prompt, 5, "cpu", context)
        assert 0 < prompt_s <= ttft_s and decode_s > 0


@needs_gpu
def test_bench_on_the_gpu_reports_share_of_peak_and_transformers(tiny_gguf):
    name, peak = card_bandwidth_gb_s()
    assert name and 100 < peak < 20_000
    from app.bench_hf import transformers_installed
    out = run_kvchat("bench", "-m", str(tiny_gguf("llama", "Q8_0")), "--backend", "torch", "--device", "cuda",
                     "-p", "32", "-n", "8", "-r", "2", "--json")
    assert out.returncode == 0, out.stderr.decode()
    rows = [json.loads(line) for line in out.stdout.decode().splitlines()]
    backends = ["torch", "transformers"] if transformers_installed() else ["torch"]
    assert {(r["backend"], r["test"]) for r in rows} == {(b, t) for b in backends for t in ("pp32", "tg8", "ttft")}
    for r in rows:
        assert r["device"] == "cuda" and r["t_s_mean"] > 0
        if r["test"] == "tg8":
            assert r["gpu"] == name and r["peak_gb_s"] == round(peak, 1)
            assert r["pct_of_peak"] == pytest.approx(100 * r["gb_s"] / peak, abs=0.1)
    assert f"GPU: {name}, peak memory bandwidth {peak:.0f} GB/s" in out.stderr.decode()
    if not transformers_installed():
        assert "transformers is not installed" in out.stderr.decode()


def test_the_cpus_read_bandwidth_is_measured_once_and_kept(tmp_path, monkeypatch):
    """bench reports CPU decode GB/s against the machine's measured read bandwidth: measured on
    first use (a positive number), then read from the cache dir; a damaged entry is measured again."""
    import app.bench as bench
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    first = bench.machine_bandwidth_gb_s()
    path = tmp_path / "bandwidth.json"
    entries = json.loads(path.read_text())
    assert first > 0 and list(entries.values()) == [first]
    key = next(iter(entries))
    assert bench.cpu_name() in key
    path.write_text(json.dumps({key: 12.5}))
    assert bench.machine_bandwidth_gb_s() == 12.5                   # kept, not measured again
    path.write_text("{not json")
    assert bench.machine_bandwidth_gb_s() > 0 and json.loads(path.read_text())[key] > 0


def test_a_mixture_of_experts_reads_its_used_experts_per_token(tiny_gguf):
    """Decode's GB/s counts expert_used_count of a layer's experts (2 of the tiny model's 8), not all."""
    from tests.engine.conftest import N_EXPERT, N_EXPERT_USED
    g = open_model(tiny_gguf("qwen3moe", "Q4_K"))
    experts = sum(t.n_bytes for name, t in g.tensors.items() if name.endswith("_exps.weight"))
    assert experts > 0
    every = sum(t.n_bytes for t in g.tensors.values()) - g.tensors["token_embd.weight"].n_bytes
    assert weight_bytes_per_token(g) == every - experts + experts * N_EXPERT_USED // N_EXPERT
