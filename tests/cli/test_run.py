"""`kvchat run`, `tokenize` and `models` driven as a user would: the installed console script."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from tests.conftest import run_kvchat

GREEDY = ["--temperature", "0", "--max-tokens", "24"]

pytestmark = pytest.mark.real_model   # drives kvchat in subprocesses


def test_run_streams_a_greedy_answer_as_json(qwen_path):
    out = run_kvchat("run", "Tell me a fun fact about the Roman Empire", "--backend", "llama.cpp", "--json", *GREEDY)
    assert out.returncode == 0, out.stderr.decode()
    result = json.loads(out.stdout)
    assert set(result) >= {"text", "tokens", "finish_reason", "timings", "model", "backend", "device", "truncated"}
    assert set(result["timings"]) == {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "ttft_ms", "cache_n", "cache_disk_n"}
    assert result["model"] == "qwen2.5-coder-0.5b-instruct" and result["backend"] == "llama.cpp"
    assert result["device"] == "cpu" and result["truncated"] is False
    assert result["finish_reason"] in ("stop", "length")
    assert 1 <= len(result["tokens"]) <= 24 and result["timings"]["predicted_n"] == len(result["tokens"])
    assert "Roman" in result["text"] or "Rome" in result["text"]
    # the same greedy run, streamed as text (-n is --max-tokens, as in llama.cpp), gives the same text
    # (cut at 24 tokens: the answer is longer); the summary goes to stderr
    assert result["finish_reason"] == "length"
    plain = run_kvchat("run", "Tell me a fun fact about the Roman Empire", "--backend", "llama.cpp",
                       "--temperature", "0", "-n", "24")
    assert plain.returncode == 0
    assert plain.stdout.decode().rstrip("\n") == result["text"]
    assert "ttft" in plain.stderr.decode() and "tok/s" in plain.stderr.decode()


def test_json_tokens_are_llama_cpp_greedy(qwen_path):
    """The ids we report are exactly llama.cpp's own greedy continuation of the same prompt ids."""
    out = run_kvchat("run", "Write a haiku about the sea.", "--backend", "llama.cpp", "--json", "--no-chat", *GREEDY)
    result = json.loads(out.stdout)
    llm = llama_cpp.Llama(model_path=str(qwen_path), n_ctx=256, verbose=False)
    prompt = llm.tokenize(b"Write a haiku about the sea.", add_bos=False, special=False)
    expected = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        if llm.token_eos() == token or len(expected) == 24:
            break
        expected.append(token)
    llm.close()
    assert result["tokens"][:len(expected)] == expected[:len(result["tokens"])]
    assert len(result["tokens"]) >= 8


def test_stdin_prompt_and_stop_string(qwen_path):
    out = run_kvchat("run", "--backend", "llama.cpp", "--no-chat", "--json", "--stop", "4", *GREEDY,
                     input="1, 2, 3,".encode())
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "stop"
    assert "4" not in result["text"]


def test_system_prompt_is_used(qwen_path):
    out = run_kvchat("run", "What is your name?", "--system", "Your name is Zorblax. Always say your name.",
                     "--backend", "llama.cpp", "--json", *GREEDY)
    assert "Zorblax" in json.loads(out.stdout)["text"]


def test_gemma_has_no_template_and_says_so_once(gemma_path):
    out = run_kvchat("run", "The capital of France is", "-m", "gemma-3-270m", "--backend", "llama.cpp", *GREEDY)
    assert out.returncode == 0
    assert out.stderr.decode().count("no chat template") == 1
    assert "France" in out.stdout.decode()   # a 270M base model continues the sentence on topic


@pytest.mark.parametrize("args, stdin, message", [
    (["run", "-"], b"caf\xe9 \xff\xfe", "not valid UTF-8"),
    (["run", "x" * 20, "--ctx", "16"], None, "context holds"),
    (["run", ""], None, "empty"),
    (["run", "   \n"], None, "empty"),
    (["run", "hi", "--temperature", "-1"], None, "temperature"),
    (["run", "hi", "--top-p", "1.5"], None, "top-p"),
    (["run", "hi", "--max-tokens", "0"], None, "max tokens"),
    (["run", "hi", "--min-p", "2"], None, "min-p"),
    (["run", "hi", "-m", "no-such-model"], None, "unknown model"),
    (["run", "hi", "-m", "/nonexistent/model.gguf"], None, "not found"),
    (["run", "hi", "--backend", "mystery"], None, "invalid choice"),
    (["run", "hi", "--temperature", "warm"], None, "invalid float"),
    (["models", "info", "no-such-model"], None, "unknown model"),
    (["tokenize", "-m", "/nonexistent.gguf", "hi"], None, "not found"),
    (["run", "hi", "--speculative", "draft"], None, "--draft-model"),
    (["run", "hi", "--ban", ""], None, "banned string"),
    (["batch", "-", "-o", "/tmp/kvchat-never-written.jsonl", "--ban", "x"], b'{"id": 1, "prompt": "hi"}\n', "--ban"),
    (["run", "hi", "--speculative", "guess"], None, "invalid choice"),
    (["run", "hi", "--speculative", "lookup", "--draft-n", "0"], None, "--draft-n"),
])
def test_bad_input_is_one_line_and_exit_2(qwen_path, args, stdin, message):
    out = run_kvchat(*args, "--backend", "llama.cpp", input=stdin) if args[0] == "run" and "--backend" not in args \
        else run_kvchat(*args, input=stdin)
    err = out.stderr.decode()
    assert out.returncode == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_prompt_longer_than_context_after_template(qwen_path):
    out = run_kvchat("run", "word " * 200, "--ctx", "64", "--backend", "llama.cpp")
    assert out.returncode == 2 and "context holds 64" in out.stderr.decode()


@pytest.fixture
def bad_files(tmp_path, qwen_path):
    files = {
        "empty": b"",
        "not_gguf": b"<html>404 Not Found</html>" * 20,
        "garbage": b"GGUF" + os.urandom(4096),
    }
    with open(qwen_path, "rb") as f:
        files["truncated"] = f.read(20_000_000)
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / f"{name}.gguf"
        paths[name].write_bytes(data)
    return paths


@pytest.mark.parametrize("kind, message", [
    ("empty", "empty"), ("not_gguf", "not a GGUF"), ("garbage", "corrupt"), ("truncated", "past the end"),
])
@pytest.mark.parametrize("command", ["info", "run"])
def test_bad_model_files(bad_files, kind, message, command):
    path = str(bad_files[kind])
    args = ["models", "info", path] if command == "info" else ["run", "hi", "-m", path, "--backend", "llama.cpp"]
    out = run_kvchat(*args)
    err = out.stderr.decode()
    assert out.returncode == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_backend_auto_hands_what_the_engine_lacks_to_llamacpp(tmp_path):
    """--backend auto (the default): a file with a tensor type kvchat's engine lacks (TQ2_0, made by
    llama.cpp's own quantizer) runs on llama.cpp, said in one line, with llama.cpp's tokens;
    --backend native refuses it in one line (exit 2); `models info` names the engine. A file neither
    engine runs is one line, exit 2."""
    from gguf import GGMLQuantizationType
    from tests.engine.conftest import requantize, write_tiny_model
    from tests.models.test_gguf_file import write_gguf
    iq = requantize(write_tiny_model(tmp_path / "f32.gguf", "llama", "F32"), tmp_path / "tq2.gguf",
                    llama_cpp.LLAMA_FTYPE_MOSTLY_TQ2_0)
    greedy = ["--no-chat", "--temperature", "0", "-n", "6", "--logit-bias", "2=-inf", "the cat"]
    auto = run_kvchat("run", "-m", str(iq), *greedy)
    assert auto.returncode == 0, auto.stderr.decode()
    assert "kvchat: kvchat's engine does not run tensor type TQ2_0 yet; using llama.cpp\n" in auto.stderr.decode()
    named = run_kvchat("run", "-m", str(iq), "--backend", "llama.cpp", *greedy)
    assert named.returncode == 0 and auto.stdout == named.stdout and auto.stdout.strip()
    native = run_kvchat("run", "-m", str(iq), "--backend", "native", *greedy)
    err = native.stderr.decode()
    assert native.returncode == 2 and len(err.strip().splitlines()) == 1 and "does not run tensor type TQ2_0" in err
    info = run_kvchat("models", "info", str(iq))
    assert "CPU kernels" not in info.stdout.decode()        # llama.cpp runs this file
    assert info.returncode == 0 and "llama.cpp (kvchat's engine does not run tensor type TQ2_0 yet)" in info.stdout.decode()

    # a tensor the engine does not read (llama.cpp's optional attention-output bias) goes the same way
    from tests.engine.conftest import N_EMBD
    biased = write_tiny_model(tmp_path / "bo.gguf", "llama", "Q8_0",
                              extra={"blk.0.attn_output.bias": np.full(N_EMBD, 0.5, np.float32)})
    auto = run_kvchat("run", "-m", str(biased), *greedy)
    assert auto.returncode == 0, auto.stderr.decode()
    assert "kvchat's engine does not run tensor blk.0.attn_output.bias yet; using llama.cpp\n" in auto.stderr.decode()
    assert auto.stdout == run_kvchat("run", "-m", str(biased), "--backend", "llama.cpp", *greedy).stdout

    neither = write_gguf(tmp_path / "mamba.gguf", arch="mamba")     # no vocabulary, no layers
    for backend in ((), ("--backend", "llama.cpp"), ("--backend", "native")):
        out = run_kvchat("run", "-m", str(neither), *backend, "hi")
        err = out.stderr.decode()
        assert out.returncode == 2 and len(err.strip().splitlines()) == 1, err
    for kind, path in (("architecture 'mamba'", neither),
                       ("tensor type IQ2_XXS", write_gguf(tmp_path / "iq2.gguf", tensor_type=GGMLQuantizationType.IQ2_XXS))):
        out = run_kvchat("models", "info", str(path))
        assert out.returncode == 0 and f"does not run {kind} yet" in out.stdout.decode()


QWEN_IM_END, QWEN_ENDOFTEXT = 151645, 151643


def test_ctrl_c_flushes_and_exits_130(qwen_path):
    exe = Path(sys.executable).parent / "kvchat"
    # The end-of-turn tokens are banned and the limit is far off, so the reply cannot finish before
    # the signal arrives, however fast this machine decodes: the test does not depend on speed.
    no_end = [arg for tok in (QWEN_IM_END, QWEN_ENDOFTEXT) for arg in ("--logit-bias", f"{tok}=-inf")]
    proc = subprocess.Popen([str(exe), "run", "Count from 1 to 1000, one number per line.", "--backend", "llama.cpp",
                             "--temperature", "0", "--max-tokens", "4000", *no_end],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    first = proc.stdout.read(8)          # wait until text is streaming
    assert first
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    text = (first + rest).decode()
    assert len(text) >= 8 and "interrupted" in err.decode()   # what streamed before Ctrl-C was kept
    assert "Traceback" not in err.decode()


def test_tokenize_cli_json(qwen_path):
    text = "Hello, мир! 😀\n<|im_end|>"
    plain = json.loads(run_kvchat("tokenize", text, "--json").stdout)
    special = json.loads(run_kvchat("tokenize", text, "--json", "--special").stdout)
    llm = llama_cpp.Llama(model_path=str(qwen_path), vocab_only=True, verbose=False)
    assert plain["tokens"] == llm.tokenize(text.encode(), add_bos=False, special=False)
    assert special["tokens"] == llm.tokenize(text.encode(), add_bos=False, special=True)
    assert special["pieces"][-1] == "<|im_end|>" and len(plain["pieces"]) == len(plain["tokens"])
    stdin = run_kvchat("tokenize", "-", "--json", input=text.encode())
    assert json.loads(stdin.stdout) == plain


def test_tokenize_bos_only_when_asked(gemma_path):
    without = json.loads(run_kvchat("tokenize", "-m", "gemma-3-270m", "hi", "--json").stdout)["tokens"]
    with_bos = json.loads(run_kvchat("tokenize", "-m", "gemma-3-270m", "hi", "--json", "--bos").stdout)["tokens"]
    assert with_bos == [2] + without


def test_models_list_info_path(qwen_path):
    listing = run_kvchat("models", "list").stdout.decode()
    for name in ("qwen2.5-coder-0.5b-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct"):
        assert name in listing
    assert run_kvchat("models", "path", "qwen2.5-coder-0.5b-instruct").stdout.decode().strip() == str(qwen_path)
    info = json.loads(run_kvchat("models", "info", "qwen2.5-coder-0.5b-instruct", "--json").stdout)
    assert info["architecture"] == "qwen2" and info["chat_template"] is True
    text = run_kvchat("models", "info", str(qwen_path)).stdout.decode()
    assert "Q4_K" in text and "context length  32768" in text
    from kernels.cpu.isa import variant
    assert f"CPU kernels     {variant()} (KVCHAT_ISA=native;" in text
    forced = run_kvchat("models", "info", str(qwen_path),
                        env={"KVCHAT_ISA": "avx2", "KVCHAT_PREFETCH": "l1", "KVCHAT_WEIGHTS": "mapped"}).stdout.decode()
    assert "CPU kernels     avx2 (KVCHAT_ISA=avx2;" in forced and "prefetch into l1 (KVCHAT_PREFETCH)" in forced
    assert "BF16 products on fma (KVCHAT_BF16)" in forced           # vdpbf16ps is an AVX-512 instruction
    assert "weights         mapped from their files (KVCHAT_WEIGHTS)" in forced
    memory = run_kvchat("models", "info", str(qwen_path), env={"KVCHAT_WEIGHTS": "memory"}).stdout.decode()
    assert "weights         read into memory (KVCHAT_WEIGHTS)" in memory


@pytest.mark.parametrize("name,value,choices", [
    ("KVCHAT_WEIGHTS", "hugepages", "auto, memory, mapped"),
    ("KVCHAT_PREFETCH", "l3", "auto, l1, l2"),
    ("KVCHAT_BF16", "bf16", "auto, vdpbf16ps, fma"),
    ("KVCHAT_ISA", "bogus", "native, avx2, avxvnni, avx512vnni, avx512amx"),
    ("KVCHAT_KV_DISK", "maybe", "auto, on, off"),
])
def test_an_unusable_setting_is_one_line_and_exit_2(qwen_path, name, value, choices):
    out = run_kvchat("run", "-m", str(qwen_path), "hi", env={name: value})
    err = out.stderr.decode()
    assert out.returncode == 2 and err.strip().splitlines() == [
        f"kvchat: error: {name}={value!r} is not one of {choices}"], err


def test_bench_json_rows(qwen_path):
    out = run_kvchat("bench", "--backend", "llama.cpp", "-p", "32", "-n", "8", "-r", "2", "--json")
    assert out.returncode == 0, out.stderr.decode()
    rows = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert {r["test"] for r in rows} == {"pp32", "tg8", "ttft"}
    for r in rows:
        assert {"backend", "test", "t_s_mean", "t_s_sd", "n", "gb_s"} <= set(r)
        assert r["backend"] == "llama.cpp" and r["n"] == 2 and r["t_s_mean"] > 0
    tg = next(r for r in rows if r["test"] == "tg8")
    assert tg["gb_s"] == pytest.approx(tg["t_s_mean"] * 0.392, rel=0.05)


def test_bench_decode_at_depth(qwen_path):
    """--depth D times decode with D tokens already in the context, on both backends."""
    out = run_kvchat("bench", "--backend", "native,llama.cpp", "-p", "16", "-n", "4", "-d", "40", "-r", "1", "--json")
    assert out.returncode == 0, out.stderr.decode()
    rows = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert {(r["backend"], r["test"]) for r in rows} == {(b, t) for b in ("native", "llama.cpp")
                                                          for t in ("pp16", "tg4@d40", "ttft")}
    assert all(r["t_s_mean"] > 0 for r in rows)
    bad = run_kvchat("bench", "-d", "-1")
    assert bad.returncode == 2 and bad.stderr.decode().count("\n") == 1 and "--depth" in bad.stderr.decode()
    too_deep = run_kvchat("bench", "-d", "100", "-n", "8", "--ctx", "64")
    assert too_deep.returncode == 2 and "do not fit" in too_deep.stderr.decode()


def test_bench_batch_against_one_by_one(qwen_path):
    """--batch N: continuous batching vs each backend one prompt at a time; it fails unless every
    batched prompt's tokens equal its one-by-one run. --processes: the same prompts through
    `kvchat run` processes against one `kvchat batch` process, which must agree too."""
    out = run_kvchat("bench", "--backend", "native,llama.cpp", "--batch", "3", "-n", "6", "--parallel", "2",
                     "--processes", "--json")
    assert out.returncode == 0, out.stderr.decode()
    row = json.loads(out.stdout.decode().splitlines()[-1])
    assert row["test"] == "batch3x6"
    assert all(row[f"{k}_t_s"] > 0 for k in ("batch", "native", "llama.cpp", "processes_run", "processes_batch"))
    assert "equal its one-by-one run" in out.stderr.decode()
    assert "kvchat batch --parallel 2" in out.stdout.decode() and "same tokens" in out.stdout.decode()
    bad = run_kvchat("bench", "--batch", "2", "--parallel", "0")
    assert bad.returncode == 2 and "--parallel" in bad.stderr.decode()
    alone = run_kvchat("bench", "--processes")
    assert alone.returncode == 2 and "--processes" in alone.stderr.decode()


def test_batch_cli_writes_every_answer_and_resumes(qwen_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    answers = tmp_path / "answers.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": f"What is {i} + {i}? Answer with a number.", "max_tokens": 8})
             for i in range(5)]
    lines.insert(2, "{not json")
    prompts.write_text("\n".join(lines) + "\n")
    out = run_kvchat("batch", str(prompts), "-o", str(answers), "--temperature", "0", "--parallel", "3")
    assert out.returncode == 0, out.stderr.decode()
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    assert sorted(r["id"] for r in records if "error" not in r) == [f"q{i}" for i in range(5)]
    assert sum("error" in r for r in records) == 1
    assert all(r["tokens"] and r["finish_reason"] in ("stop", "length") for r in records if "error" not in r)
    with prompts.open("a") as f:
        f.write(json.dumps({"id": "q9", "prompt": "Say hi."}) + "\n")
    again = run_kvchat("batch", str(prompts), "-o", str(answers), "--temperature", "0", "--max-tokens", "8")
    assert again.returncode == 0
    ids = [json.loads(line)["id"] for line in answers.read_text().splitlines()]
    assert ids.count("q9") == 1 and ids.count("q0") == 1          # done ids were skipped


@pytest.mark.parametrize("method", ["lookup", "draft"])
def test_run_speculative_prints_acceptance_and_the_same_text(qwen_path, qwen15_path, method):
    """`kvchat run --speculative` streams exactly the plain greedy text and reports its acceptance;
    draft: qwen2.5-coder-0.5b drafting for -1.5b."""
    prompt = "Rename the function area to rectangle_area and change nothing else:\n\n" \
             "def area(width, height):\n    return width * height\n"
    model = ["-m", "qwen2.5-coder-1.5b-instruct"] if method == "draft" else []
    common = ["run", prompt, "--backend", "native", *model, "--temperature", "0", "--max-tokens", "32"]
    plain = run_kvchat(*common)
    spec = run_kvchat(*common, "--speculative", method, "--draft-model", "qwen2.5-coder-0.5b-instruct")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr.decode()
    assert spec.stdout == plain.stdout and "rectangle_area" in spec.stdout.decode()
    err = spec.stderr.decode()
    assert f"speculative {method}: accepted" in err and "%)" in err, err


def test_a_vocabulary_we_lack_is_tokenized_by_llamacpp(tmp_path):
    """A pre-tokenizer llama.cpp knows and kvchat's tokenizer does not ("viking", a Llama-architecture
    file's): llama.cpp's own load of the vocabulary tokenizes, so kvchat's engine still runs the
    file on llama.cpp's ids: the prompt's token count is llama.cpp's, and the greedy reply is
    --backend llama.cpp's token for token. `models info` says whose tokenizer it is."""
    from tests.engine.conftest import write_tiny_model
    lacking = write_tiny_model(tmp_path / "viking.gguf", "llama", "Q8_0", bpe_pre="viking")
    prompt = "the cat sat on the mat (1 + 1) = print"
    greedy = ["--no-chat", "--temperature", "0", "-n", "8", "--logit-bias", "319=-inf", "--json", prompt]
    auto = run_kvchat("run", "-m", str(lacking), *greedy)
    assert auto.returncode == 0 and "using llama.cpp" not in auto.stderr.decode(), auto.stderr.decode()
    ours = json.loads(auto.stdout)
    theirs = llama_cpp.Llama(model_path=str(lacking), vocab_only=True, verbose=False)
    try:
        n_prompt = len(theirs.tokenize(prompt.encode(), add_bos=True, special=False))
    finally:
        theirs.close()
    assert ours["backend"] == "native" and ours["timings"]["prompt_n"] == n_prompt
    named = run_kvchat("run", "-m", str(lacking), "--backend", "llama.cpp", *greedy)
    assert named.returncode == 0 and json.loads(named.stdout)["tokens"] == ours["tokens"]
    info = run_kvchat("models", "info", str(lacking)).stdout.decode()
    assert "tokenizer       llama.cpp's (kvchat's does not split pre-tokenizer 'viking' yet)" in info
    assert "engine          kvchat's own" in info
    # a name neither knows: one line, exit 2, whatever the engine
    unknown = write_tiny_model(tmp_path / "nonsense.gguf", "llama", "Q8_0", bpe_pre="nonsense")
    for backend in ("auto", "native", "llama.cpp"):
        out = run_kvchat("run", "-m", str(unknown), "--backend", backend, "hi")
        err = out.stderr.decode()
        assert out.returncode == 2 and len(err.strip().splitlines()) == 1 and "pre-tokenizer 'nonsense'" in err, err


def test_mistral3_past_its_temperature_floor_runs_on_llamacpp(tmp_path):
    """A mistral3 file's attention temperature is exactly 1 within its YaRN original context (here
    128): --ctx 128 runs on kvchat's engine, a longer context on llama.cpp (one line), with the same
    greedy tokens for a short prompt; --backend native refuses the longer context in one line."""
    from tests.engine.conftest import write_tiny_model
    path = str(write_tiny_model(tmp_path / "m3.gguf", "mistral3", "Q8_0", meta=(("rope.scaling.original_context_length", 128),)))
    greedy = ["--no-chat", "--temperature", "0", "-n", "6", "--json", "the cat sat"]
    within, past = (run_kvchat("run", "-m", path, "--ctx", ctx, *greedy) for ctx in ("128", "200"))
    assert within.returncode == 0 and past.returncode == 0, past.stderr.decode()
    assert json.loads(within.stdout)["backend"] == "native" and json.loads(past.stdout)["backend"] == "llama.cpp"
    assert "attention temperature scaling past 128 tokens of context (--ctx 128 runs it) yet; using llama.cpp" \
        in past.stderr.decode()
    assert json.loads(within.stdout)["tokens"] == json.loads(past.stdout)["tokens"]
    native = run_kvchat("run", "-m", path, "--ctx", "200", "--backend", "native", *greedy)
    err = native.stderr.decode()
    assert native.returncode == 2 and len(err.strip().splitlines()) == 1 and "attention temperature" in err, err


def test_a_mixture_of_experts_runs_on_kvchats_engine(tmp_path):
    """A Qwen3-MoE file (tiny, random): `--backend auto` runs it on kvchat's engine, whose greedy
    reply is llama.cpp's token for token; `models info` names its experts."""
    from tests.engine.conftest import write_tiny_model
    path = write_tiny_model(tmp_path / "qwen3moe.gguf", "qwen3moe", "Q4_K")
    greedy = ["--no-chat", "--temperature", "0", "-n", "12", "--json", "the cat sat on the mat"]
    auto = run_kvchat("run", "-m", str(path), *greedy)
    assert auto.returncode == 0 and "using llama.cpp" not in auto.stderr.decode(), auto.stderr.decode()
    ours = json.loads(auto.stdout)
    theirs = run_kvchat("run", "-m", str(path), "--backend", "llama.cpp", *greedy)
    assert ours["backend"] == "native" and len(ours["tokens"]) == 12
    assert json.loads(theirs.stdout)["tokens"] == ours["tokens"]
    info = run_kvchat("models", "info", str(path)).stdout.decode()
    assert "experts         8, 2 per token" in info and "engine          kvchat's own (native on the CPU, torch on a GPU)" in info
    # more experts per token than the file has: one line, exit 2
    bad = write_tiny_model(tmp_path / "bad.gguf", "qwen3moe", "Q4_K", meta=(("expert_used_count", 9),))
    out = run_kvchat("run", "-m", str(bad), "--backend", "native", "hi")
    err = out.stderr.decode()
    assert out.returncode == 2 and len(err.strip().splitlines()) == 1 and "9 of 8 experts per token" in err, err
