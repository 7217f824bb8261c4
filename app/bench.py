"""`kvchat bench`: llama-bench's tests (pp N, tg N, tg N at depth D) plus TTFT, with backends interleaved.

Each round runs every backend once, test by test, so a slow patch of a noisy machine hits them
alike and their ratio holds. Decode GB/s = weight bytes read per token x tokens/s; a row on CUDA
also gives it as a share of the card's peak memory bandwidth. With the torch engine on CUDA, HF
transformers (where installed) runs the same GGUF on the same prompt ids as a peer (app.bench_hf).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from app.bench_hf import time_transformers
from app.bench_hf import weight_bytes_per_token as hf_weight_bytes_per_token
from core.engine import BACKEND_NAMES, cuda_available
from core.tokenizer import Tokenizer
from core.sampler import Sampler
from core.types import SamplingParams
from models import registry
from models.errors import BadInputError
from models.gguf_file import open_model

PEER = "llama.cpp-peer"     # llama.cpp with every SIMD extension of this CPU, in its own process (app.peer)
# Each round also runs the read probe on this many bytes (far beyond any cache): decode's "% now" is
# against the memory of the same minutes, which on a shared machine moves by more than a change does.
PROBE_BYTES = 256 << 20


def weight_bytes_per_token(gguf, tensor_bytes=lambda t: t.n_bytes) -> int:
    """Bytes of weights a decode step reads: every tensor once, except the embedding table, of which
    only one row is read, unless it doubles as the output matrix (tied embeddings), and a mixture
    of experts' experts, of which a token reads expert_used_count. tensor_bytes: a tensor's size as
    the engine keeps it (default: as in the file)."""
    total = sum(tensor_bytes(t) * gguf.token_share(name) for name, t in gguf.tensors.items())
    embd = gguf.tensors.get("token_embd.weight")
    if embd is not None and "output.weight" in gguf.tensors:
        total -= tensor_bytes(embd)
    return int(total)


def torch_weight_bytes_per_token(gguf) -> int:
    """weight_bytes_per_token as the torch engine keeps the weights on CUDA (quantized where its
    kernels read the type, else float16: core.torch_backend.cuda_tensor_bytes)."""
    from core.torch_backend import cuda_tensor_bytes
    return weight_bytes_per_token(gguf, cuda_tensor_bytes)


def peak_bandwidth_gb_s(memory_clock_khz: float, bus_width_bits: int) -> float:
    """A card's peak memory bandwidth in GB/s: its memory clock (kHz, as CUDA reports it) x 2
    transfers a clock (double data rate) x the bus width in bytes."""
    return 2 * memory_clock_khz * 1e3 * bus_width_bits / 8 / 1e9


def card_bandwidth_gb_s(device_index: int = 0) -> tuple[str, float] | None:
    """(name, peak memory bandwidth in GB/s) of CUDA device `device_index`, or None without one
    (or when the driver reports no memory clock or bus width)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device_index)
    clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if not clock or not bus:
        return None
    return props.name, peak_bandwidth_gb_s(clock, bus)


def cpu_name() -> str:
    """The CPU's model name, family and model (/proc/cpuinfo), or the platform's processor string."""
    import platform

    from app.peer import cpuinfo
    if cpuinfo("model name") is None:
        return platform.processor() or "unknown CPU"
    return f"{cpuinfo('model name')} (family {cpuinfo('cpu family')}, model {cpuinfo('model')})"


def machine_bandwidth_gb_s() -> float:
    """The machine's read bandwidth (kernels.cpu.bandwidth), measured once per CPU model and thread
    count and kept in the cache dir: decode's GB/s is reported against it."""
    import numba

    from core.paths import cache_dir
    path = cache_dir() / "bandwidth.json"
    key = f"{cpu_name()} x {numba.get_num_threads()} threads"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict) or not isinstance(known.get(key), (int, float)) or known[key] <= 0:
        from kernels.cpu.bandwidth import read_bandwidth_gb_s
        print("measuring the machine's read bandwidth (once)…", file=sys.stderr)
        known = {**(known if isinstance(known, dict) else {}), key: round(read_bandwidth_gb_s(), 2)}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(path)
    return float(known[key])


def random_prompt(rng: np.random.Generator, n: int, n_vocab: int, avoid: frozenset[int]) -> list[int]:
    ids = rng.integers(0, n_vocab, size=n).tolist()
    return [i if i not in avoid else 0 for i in ids]


def time_prefill(engine, ids: list[int]) -> tuple[float, float]:
    """Seconds for prefill of `ids` from an empty cache, and seconds to the first sampled token."""
    params = SamplingParams(temperature=0, max_tokens=1)
    for _ in engine.backend.generate(ids, params):
        pass
    timings = engine.backend.timings
    if timings.cache_n:
        raise RuntimeError("bench prompt unexpectedly hit the prefix cache")
    return timings.prompt_ms / 1000, timings.ttft_ms / 1000


def time_decode(engine, first: int, n_gen: int, context: list[int] | None = None) -> float:
    """Seconds for n_gen decode steps after a 1-token prompt, or after `context` (prefilled first,
    untimed: decode at depth), ignoring end-of-generation tokens."""
    backend = engine.backend
    backend.rollback(0)                    # an empty sequence
    ids = list(context or []) + [first]
    for start in range(0, len(ids) - 1, 512):
        backend.extend(ids[start:min(start + 512, len(ids) - 1)])
    greedy = Sampler(SamplingParams(temperature=0), backend.tokenizer.n_vocab)
    token = backend.extend_sample(ids[-1:], greedy)
    t0 = time.perf_counter()
    for _ in range(n_gen):         # the backend picks each token where its logits are (a GPU's: on it)
        token = backend.extend_sample([token], greedy)
    return time.perf_counter() - t0


REWRITE_CODE = '''def collect_even_squares(numbers):
    """Return the squares of the even numbers, in order."""
    result = []
    for number in numbers:
        if number % 2 == 0:
            result.append(number * number)
    return result


def describe(numbers):
    """Return a short description of a list of numbers."""
    total = sum(numbers)
    count = len(numbers)
    average = total / count if count else 0.0
    return f"{count} numbers, total {total}, average {average:.2f}"


def clamp(value, low, high):
    """Clamp value into [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
'''
SPECULATIVE_PROMPT = "Rename the function describe to summarize in this code, and change nothing else:\n\n" + REWRITE_CODE
HISTORY_SENTENCE = "The archive holds letters, maps and ledgers from the harbour office, sorted by year. "


def bench_multiturn(engine, reps: int, new_tokens: int = 20, history_tokens: int = 1500) -> dict:
    """TTFT of a new message after a long conversation, with the history reused from the KV cache,
    against prefilling the new message alone and against recomputing everything."""
    from core.types import SamplingParams
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=1)
    unit = tok.encode(HISTORY_SENTENCE)
    history = (unit * (history_tokens // len(unit) + 1))[:history_tokens]
    rng = np.random.default_rng(1)
    warm, alone, cold = [], [], []
    for _ in range(reps):
        message = random_prompt(rng, new_tokens, tok.n_vocab, tok.eog_ids)
        fresh_history = random_prompt(rng, 1, tok.n_vocab, tok.eog_ids) + history
        list(engine.backend.generate(fresh_history, params))            # the conversation so far
        list(engine.backend.generate(fresh_history + message, params))  # the new turn, history reused
        warm.append(engine.backend.timings.ttft_ms)
        assert engine.backend.timings.cache_n >= len(fresh_history) - 1
        list(engine.backend.generate(random_prompt(rng, new_tokens, tok.n_vocab, tok.eog_ids), params))
        alone.append(engine.backend.timings.ttft_ms)
        list(engine.backend.generate(random_prompt(rng, 1, tok.n_vocab, tok.eog_ids) + history + message, params))
        cold.append(engine.backend.timings.ttft_ms)
    return {"ttft_reused_ms": statistics.fmean(warm), "ttft_alone_ms": statistics.fmean(alone),
            "ttft_recompute_ms": statistics.fmean(cold)}


def bench_speculative(engine, reps: int, n_gen: int, draft_n: int | None = None, draft_model: str | None = None) -> dict:
    """Decode tokens/s on an input-grounded prompt (greedy): plain, prompt lookup and, with
    draft_model, a draft model. Every speculative run must give the plain run's tokens."""
    from core.types import SamplingParams, SpeculativeConfig
    ids = engine.prompt_ids(SPECULATIVE_PROMPT)
    params = SamplingParams(temperature=0, max_tokens=n_gen)
    configs = {"plain": None, "lookup": SpeculativeConfig("lookup", draft_n).validate()}
    if draft_model:
        configs["draft"] = SpeculativeConfig("draft", draft_n, draft_model).validate()
        list(engine.generate(ids[:8], SamplingParams(temperature=0, max_tokens=2), speculative=configs["draft"]))
    speed = {k: [] for k in configs}
    drafted = {k: 0 for k in configs}
    accepted = {k: 0 for k in configs}
    for _ in range(reps):
        reference = None
        for method, config in configs.items():
            tokens = [e.id for e in engine.generate(ids, params, speculative=config) if e.id >= 0]
            speed[method].append(engine.backend.timings.predicted_per_second)
            if config is None:
                reference = tokens
                continue
            drafted[method] += engine.backend.stats.spec_drafted
            accepted[method] += engine.backend.stats.spec_accepted
            if tokens != reference:
                raise RuntimeError(f"speculative ({method}) output differs from plain greedy output")
    out = {"plain_t_s": statistics.fmean(speed["plain"])}
    for method in configs:
        if method != "plain":
            out[f"{method}_t_s"] = statistics.fmean(speed[method])
            out[f"{method}_acceptance"] = accepted[method] / drafted[method] if drafted[method] else 0.0
    return out


JSON_PROMPT = ('List ten classic novels as JSON, in the form {"books": [{"title": "...", "author": "...", '
               '"year": 1900}, ...]}.')
JSON_SCHEMA = {"type": "object", "required": ["books"], "properties": {"books": {"type": "array", "items": {
    "type": "object", "required": ["title", "author", "year"], "additionalProperties": False,
    "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}}}}}}


def bench_json_schema(engine, reps: int, n_gen: int) -> dict:
    """Decode t/s on one prompt (greedy, up to n_gen tokens) without and with a JSON schema, rounds
    interleaved in alternating order: what masking the logits every step (core.constrained) costs.
    A schema run that completes must be JSON."""
    plain = SamplingParams(temperature=0, max_tokens=n_gen)
    schema = SamplingParams(temperature=0, max_tokens=n_gen, json_schema=json.dumps(JSON_SCHEMA))
    ids = engine.prompt_ids(JSON_PROMPT, chat=engine.has_chat_template)
    list(engine.generate(ids, SamplingParams(temperature=0, max_tokens=2, json_schema=schema.json_schema)))  # warm-up
    speed = {"plain": [], "schema": []}
    tokens = {"plain": 0, "schema": 0}
    for rep in range(reps):
        runs = [("plain", plain), ("schema", schema)]
        for name, params in (runs if rep % 2 == 0 else runs[::-1]):     # neither always runs first
            text = "".join(e.text for e in engine.generate(ids, params))
            speed[name].append(engine.backend.timings.predicted_per_second)
            tokens[name] += engine.backend.timings.predicted_n
            if name == "schema" and engine.backend.finish_reason == "stop":
                json.loads(text)
    return {"plain_t_s": statistics.fmean(speed["plain"]), "schema_t_s": statistics.fmean(speed["schema"]),
            "plain_tokens": tokens["plain"] / reps, "schema_tokens": tokens["schema"] / reps}


BATCH_TOPICS = ["the sea", "a lighthouse", "binary search", "autumn", "a robot", "coffee", "the moon", "trains",
                "recursion", "a garden", "winter", "a library", "bees", "mountains", "rain", "a clock"]
BATCH_TASKS = ["Write a short poem about {}.", "Explain {} to a child."]


def batch_prompts(n: int) -> list[str]:
    return [BATCH_TASKS[i % 2].format(BATCH_TOPICS[(i // 2) % len(BATCH_TOPICS)]) + ("" if i < 32 else f" ({i})")
            for i in range(n)]


def bench_one_by_one(engine, prompts: list[str], n_gen: int) -> tuple[float, list[list[int]]]:
    """Tokens/s running the prompts one after another (greedy, max n_gen tokens each), and the tokens."""
    params = SamplingParams(temperature=0, max_tokens=n_gen)
    outputs, t0 = [], time.perf_counter()
    for prompt in prompts:
        ids = engine.prompt_ids(prompt, chat=engine.has_chat_template)
        outputs.append([e.id for e in engine.generate(ids, params) if e.id >= 0])
    return sum(map(len, outputs)) / (time.perf_counter() - t0), outputs


def bench_batch(engine, prompts: list[str], n_gen: int, parallel: int) -> tuple[float, list[list[int]], int]:
    """Tokens/s of continuous batching over the prompts (greedy), their tokens, and the steps taken."""
    from core.batch import BatchRequest, BatchScheduler
    params = SamplingParams(temperature=0, max_tokens=n_gen)
    requests = [BatchRequest(i, engine.prompt_ids(p, chat=engine.has_chat_template), params)
                for i, p in enumerate(prompts)]
    scheduler = BatchScheduler(engine.backend, parallel)
    outputs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for res in scheduler.results(requests):
        if res.error:
            raise RuntimeError(f"batch request {res.id}: {res.error}")
        outputs[res.id] = res.tokens
    return sum(map(len, outputs)) / (time.perf_counter() - t0), outputs, scheduler.steps


def kvchat_process(cmd: list[str], env: dict | None = None) -> str:
    """Run `kvchat CMD...` in a new process, as a user would; its stdout (RuntimeError if it fails)."""
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "app.cli", *cmd], capture_output=True, text=True, check=False,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"kvchat {cmd[0]} failed: {proc.stderr.strip()[-300:]}")
    return proc.stdout


def bench_processes(model: str, prompts: list[str], n_gen: int, parallel: int, threads: int | None) -> dict:
    """The batch bar as a user meets it: each prompt through its own `kvchat run` process, one after
    another, against one `kvchat batch` process over all of them (greedy, native). Wall time from
    each process's start, model load included. Both must give the same tokens."""
    import tempfile
    from pathlib import Path

    common = ["-m", model, "--backend", "native", "--max-tokens", str(n_gen), "--temperature", "0", "--kv-disk", "off"]
    if threads:
        common += ["--threads", str(threads)]
    run = kvchat_process

    t0 = time.perf_counter()
    solo = [json.loads(run(["run", p, "--json"] + common))["tokens"] for p in prompts]
    t_solo = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "prompts.jsonl"), Path(tmp, "answers.jsonl")
        src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
        t0 = time.perf_counter()
        run(["batch", str(src), "-o", str(dst), "--parallel", str(parallel)] + common)
        t_batch = time.perf_counter() - t0
        answers = {a["id"]: a["tokens"] for a in map(json.loads, dst.read_text().splitlines())}
    if [answers.get(i) for i in range(len(prompts))] != solo:
        raise RuntimeError("kvchat batch gave other tokens than kvchat run")
    n = sum(map(len, solo))
    return {"run_t_s": n / t_solo, "batch_t_s": n / t_batch, "tokens": n}


def cmd_bench_batch(args, engines) -> int:
    """--batch N: N prompts x up to -n tokens, greedy, through continuous batching (native) against
    each backend one prompt after another in-process. Batched tokens must equal the one-by-one ones."""
    prompts = batch_prompts(args.batch)
    rates: dict[str, float] = {}
    for name, engine in engines.items():
        list(engine.generate(engine.prompt_ids("Hi", chat=False), SamplingParams(temperature=0, max_tokens=2)))
        rates[name], outs = bench_one_by_one(engine, prompts, args.n_gen)
        print(f"{name:<10} one by one: {len(prompts)} prompts, {sum(map(len, outs))} tokens, {rates[name]:.1f} t/s",
              file=sys.stderr)
        if name == "native":
            batch_rate, batch_outs, steps = bench_batch(engine, prompts, args.n_gen, args.parallel)
            same = sum(a == b for a, b in zip(batch_outs, outs))
            if same != len(prompts):
                raise RuntimeError(f"batched output differs from one-by-one output on {len(prompts) - same} prompts")
            rates["batch"] = batch_rate
            print(f"{name:<10} batch --parallel {args.parallel}: {sum(map(len, batch_outs))} tokens in {steps} steps, "
                  f"{batch_rate:.1f} t/s (every prompt's tokens equal its one-by-one run)", file=sys.stderr)
    if args.processes:
        model = args.model or registry.DEFAULT_MODEL
        r = bench_processes(model, prompts, args.n_gen, args.parallel, args.threads)
        print(f"processes  kvchat run x{len(prompts)}: {r['run_t_s']:.1f} t/s | kvchat batch --parallel {args.parallel}: "
              f"{r['batch_t_s']:.1f} t/s = {r['batch_t_s'] / r['run_t_s']:.2f}x (wall time, loads included; same tokens)")
        rates["processes_run"], rates["processes_batch"] = r["run_t_s"], r["batch_t_s"]
    if "batch" in rates:
        line = f"batch {len(prompts)}x{args.n_gen}: {rates['batch']:.1f} t/s"
        for name in engines:
            line += f" | {name} one by one {rates[name]:.1f} t/s (batch {rates['batch'] / rates[name]:.2f}x)"
        print(line)
    if args.json:
        print(json.dumps({"test": f"batch{len(prompts)}x{args.n_gen}", **{f"{k}_t_s": round(v, 2)
                                                                            for k, v in rates.items()}}))
    return 0


def cmd_bench_modes(args, engines) -> int:
    for name, engine in engines.items():
        if args.multiturn:
            r = bench_multiturn(engine, args.repetitions)
            print(f"{name:<10} multiturn: TTFT with 1500 tokens of history reused {r['ttft_reused_ms']:.0f} ms | "
                  f"20-token prompt alone {r['ttft_alone_ms']:.0f} ms | full recompute {r['ttft_recompute_ms']:.0f} ms | "
                  f"reused/alone {r['ttft_reused_ms'] / r['ttft_alone_ms']:.2f}x")
            if args.json:
                print(json.dumps({"backend": name, "test": "multiturn", **{k: round(v, 2) for k, v in r.items()}}))
        if args.speculative:
            if not engine.backend.capabilities.speculative:
                print(f"{name:<10} speculative: not supported by this backend")
                continue
            r = bench_speculative(engine, args.repetitions, args.n_gen, args.draft_n, args.draft_model)
            for method in ("lookup", "draft"):
                if f"{method}_t_s" in r:
                    print(f"{name:<10} speculative {method}: {r[f'{method}_t_s']:.1f} t/s vs plain {r['plain_t_s']:.1f} t/s "
                          f"= {r[f'{method}_t_s'] / r['plain_t_s']:.2f}x, acceptance "
                          f"{100 * r[f'{method}_acceptance']:.0f}% (same tokens)")
            if args.json:
                print(json.dumps({"backend": name, "test": "speculative", **{k: round(v, 3) for k, v in r.items()}}))
        if args.json_schema:
            r = bench_json_schema(engine, args.repetitions, args.n_gen)
            print(f"{name:<10} json schema: {r['schema_t_s']:.1f} t/s vs plain {r['plain_t_s']:.1f} t/s "
                  f"= {r['schema_t_s'] / r['plain_t_s']:.2f}x ({r['schema_tokens']:.0f} and {r['plain_tokens']:.0f} tokens a run)")
            if args.json:
                print(json.dumps({"backend": name, "test": "json_schema", **{k: round(v, 3) for k, v in r.items()}}))
    return 0


def cmd_bench(args) -> int:
    from app.cli import load_engine
    if args.resume:
        from app.bench_resume import cmd_bench_resume
        return cmd_bench_resume(args)
    modes = bool(args.batch or args.multiturn or args.speculative or args.json_schema)   # the peer: pp/tg/TTFT only
    default = ["native", "llama.cpp" if modes else PEER] + (["torch"] if args.device == "cuda" or cuda_available() else [])
    if args.json_schema and not (args.multiturn or args.speculative):
        default = ["native"]                  # the mask's cost is the engine's own: one backend shows it
    names = [b.strip() for b in (args.backend or ",".join(default)).split(",") if b.strip()]
    for name in names:
        if name not in BACKEND_NAMES + (PEER,) or name == "auto":
            raise BadInputError(f"unknown backend '{name}' (choose from {', '.join(BACKEND_NAMES[1:] + (PEER,))})")
    if args.n_prompt < 1 or args.n_gen < 1 or args.repetitions < 1:
        raise BadInputError("-p, -n and -r must be at least 1")
    if args.depth < 0:
        raise BadInputError("--depth must be >= 0")
    if args.batch < 0 or args.parallel < 1:
        raise BadInputError("--batch must be >= 0 and --parallel >= 1")
    if args.processes and not args.batch:
        raise BadInputError("--processes goes with --batch N")
    if PEER in names and modes:
        raise BadInputError(f"{PEER} takes part in the pp/tg/TTFT bench only")
    model = args.model or registry.DEFAULT_MODEL
    args.ctx = args.ctx or max(args.n_prompt, args.depth + args.n_gen + 1,
                               2048 if (args.multiturn or args.speculative) else 0) + 64
    if args.depth + args.n_gen + 1 > args.ctx:
        raise BadInputError(f"--depth {args.depth} + -n {args.n_gen} do not fit --ctx {args.ctx}")
    if "torch" in names and args.device == "cuda":
        from core.engine import pick_backend
        pick_backend("torch", "cuda")          # no CUDA: one line and exit 2 before any model loads
    engines, device, peer = {}, args.device, None
    for name in names:
        if name == PEER:                      # in a process of its own (app.peer)
            from app.peer import PeerEngine
            from app.progress import stderr_progress
            with stderr_progress() as progress:
                path = registry.resolve(model, progress)
            peer = PeerEngine(str(path), args.ctx, args.threads, log=lambda line: print(line, file=sys.stderr))
            built = [f for f in ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI") if f"{f} = 1" in peer.info["system_info"]]
            print(f"{PEER}: llama.cpp built with AVX2" + "".join(f", {f}" for f in built), file=sys.stderr)
            continue
        args.backend, args.device = name, (device if name == "torch" else "cpu")
        engines[name] = load_engine(args, model)
    if args.batch:
        return cmd_bench_batch(args, engines)
    if args.multiturn or args.speculative or args.json_schema:
        return cmd_bench_modes(args, engines)
    gguf = open_model(registry.resolve(model))
    tokenizer = next(iter(engines.values())).tokenizer if engines else Tokenizer.from_gguf(gguf)
    n_vocab, avoid = tokenizer.n_vocab, tokenizer.eog_ids
    devices = {name: ("cpu" if name == PEER else engines[name].device) for name in names}
    bytes_per_token = {name: (torch_weight_bytes_per_token(gguf) if devices[name] == "cuda"
                              else weight_bytes_per_token(gguf)) for name in devices}
    hf = None
    if devices.get("torch") == "cuda":
        hf = load_transformers_peer(gguf.path)
        if hf is not None:
            devices["transformers"] = "cuda"
            bytes_per_token["transformers"] = hf_weight_bytes_per_token(hf)
    rng = np.random.default_rng(0)

    # warm-up: compile kernels, fault in pages. On a GPU at the test's own prompt length: its first
    # round otherwise still pays for kernels compiled and tuned per shape (Triton's, cuBLAS's; seen
    # on an H200 as first pp512 and tg128 rounds far below the next two, for both GPU engines)
    n_warm = args.n_prompt if "cuda" in devices.values() else min(args.n_prompt, 64)
    for engine in engines.values():
        time_prefill(engine, random_prompt(rng, n_warm, n_vocab, avoid))
        time_decode(engine, 1, 4)
    if hf is not None:
        time_transformers(hf, random_prompt(rng, n_warm, n_vocab, avoid), 4, "cuda")
    if peer is not None:
        peer.time(random_prompt(rng, min(args.n_prompt, 64), n_vocab, avoid), 4)

    samples: dict[tuple[str, str], list[float]] = {}
    probes: list[float] = []                  # the read probe's GB/s, once per round
    pp, tg = f"pp{args.n_prompt}", f"tg{args.n_gen}" + (f"@d{args.depth}" if args.depth else "")
    from kernels.cpu.bandwidth import read_bandwidth_gb_s
    for rep in range(args.repetitions):
        for name in devices:
            prompt = random_prompt(rng, args.n_prompt, n_vocab, avoid)
            context = random_prompt(rng, args.depth, n_vocab, avoid) if args.depth else None
            if name == "transformers":
                prompt_s, ttft_s, decode_s = time_transformers(hf, prompt, args.n_gen, "cuda", context)
            elif name == PEER:
                prompt_s, ttft_s, decode_s = peer.time(prompt, args.n_gen, context)
            else:
                prompt_s, ttft_s = time_prefill(engines[name], prompt)
                decode_s = time_decode(engines[name], prompt[0], args.n_gen, context)
            samples.setdefault((name, pp), []).append(args.n_prompt / prompt_s)
            samples.setdefault((name, "ttft"), []).append(ttft_s * 1000)
            samples.setdefault((name, tg), []).append(args.n_gen / decode_s)
            print(f"round {rep + 1}/{args.repetitions} {name}: {pp} {args.n_prompt / prompt_s:.1f} t/s, "
                  f"{tg} {args.n_gen / decode_s:.1f} t/s", file=sys.stderr)
        if "cpu" in devices.values():          # the memory of this round, beside its decodes
            probes.append(read_bandwidth_gb_s(PROBE_BYTES, 3))
            print(f"round {rep + 1}/{args.repetitions} read probe: {probes[-1]:.1f} GB/s", file=sys.stderr)

    card = card_bandwidth_gb_s() if "cuda" in devices.values() else None
    memory = machine_bandwidth_gb_s() if "cpu" in devices.values() else None   # the CPU's measured read GB/s
    now = statistics.fmean(probes) if probes else None                          # ... in this run's rounds
    names = list(devices)
    rows = []
    for (name, test), values in samples.items():
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        row = {"backend": name, "test": test, "t_s_mean": None, "t_s_sd": None, "n": len(values), "gb_s": None,
               "model": model, "device": devices[name], "threads": args.threads}
        if test == "ttft":
            row.update(ms_mean=round(mean, 2), ms_sd=round(sd, 2), t_s_mean=round(args.n_prompt / (mean / 1000), 2))
            row["t_s_sd"] = 0.0
        else:
            row.update(t_s_mean=round(mean, 2), t_s_sd=round(sd, 2))
            if test == tg:
                gb_s = mean * bytes_per_token[name] / 1e9
                row["gb_s"] = round(gb_s, 2)
                row["tpot_ms"] = round(1000 / mean, 2)
                if card is not None and devices[name] == "cuda":
                    row.update(gpu=card[0], peak_gb_s=round(card[1], 1), pct_of_peak=round(100 * gb_s / card[1], 1))
                elif memory is not None and devices[name] == "cpu":
                    row.update(peak_gb_s=memory, pct_of_peak=round(100 * gb_s / memory, 1),
                               now_gb_s=round(now, 2), pct_of_now=round(100 * gb_s / now, 1))
        rows.append(row)
    order = {pp: 0, tg: 1, "ttft": 2}
    rows.sort(key=lambda r: (order[r["test"]], names.index(r["backend"])))
    if card is not None:
        print(f"GPU: {card[0]}, peak memory bandwidth {card[1]:.0f} GB/s", file=sys.stderr if args.json else sys.stdout)
    if memory is not None:
        from kernels.cpu.isa import variant
        print(f"CPU: {cpu_name()}, kernels {variant()}, measured read bandwidth {memory:.1f} GB/s on "
              f"{args.threads or 'all'} threads (decode's % peak is against it), {now:.1f} GB/s in this run's rounds "
              f"(% now)", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows, names, bytes_per_token)
    if args.plot:
        plot(rows, args.plot, model)
    for engine in engines.values():
        engine.close()
    if peer is not None:
        peer.close()
    return 0


def load_transformers_peer(path):
    """HF transformers on the same GGUF on CUDA, or None (said on stderr) when it is not installed
    or cannot load this file."""
    from app.bench_hf import load_transformers, transformers_installed
    if not transformers_installed():
        print("transformers is not installed: the HF transformers peer is skipped", file=sys.stderr)
        return None
    try:
        return load_transformers(path, "cuda")
    except Exception as e:   # noqa: BLE001 - a type or architecture transformers' GGUF loader lacks: bench the rest
        print(f"transformers could not load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
              "the HF transformers peer is skipped", file=sys.stderr)
        return None


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(backend, base) pairs the ratio lines compare: every engine against the llama.cpp peer when
    it ran (else against the last engine named), and the torch engine against HF transformers
    when that peer ran."""
    engines = [n for n in names if n != "transformers"]
    base = PEER if PEER in engines else (engines[-1] if engines else None)
    pairs = [(name, base) for name in engines if name != base]
    if "transformers" in names and "torch" in engines:
        pairs.append(("torch", "transformers"))
    return pairs


def print_table(rows: list[dict], names: list[str], bytes_per_token: dict[str, int]) -> None:
    peak = any("pct_of_peak" in r for r in rows)
    now = any("pct_of_now" in r for r in rows)
    wide = max([12] + [len(r["backend"]) for r in rows])
    print(f"{'backend':<{wide}} {'test':<8} {'t/s':>16} {'ms':>16} {'GB/s':>7}" + (f" {'% peak':>6}" if peak else "")
          + (f" {'% now':>6}" if now else ""))
    for r in rows:
        ts = f"{r['t_s_mean']:.2f} ± {r['t_s_sd']:.2f}"
        ms = f"{r['ms_mean']:.1f} ± {r['ms_sd']:.1f}" if "ms_mean" in r else (f"{r['tpot_ms']:.2f} tpot" if "tpot_ms" in r else "")
        gb = f"{r['gb_s']:.1f}" if r["gb_s"] is not None else ""
        pct = f" {r['pct_of_peak']:>5.1f}%" if "pct_of_peak" in r else ""
        pct += f" {r['pct_of_now']:>5.1f}%" if "pct_of_now" in r else ""
        print(f"{r['backend']:<{wide}} {r['test']:<8} {ts:>16} {ms:>16} {gb:>7}{pct}")
    for test in dict.fromkeys(r["test"] for r in rows):
        by = {r["backend"]: r for r in rows if r["test"] == test}
        for name, base in ratio_pairs(names):
            if test == "ttft":
                ratio = by[base]["ms_mean"] / by[name]["ms_mean"]
            else:
                ratio = by[name]["t_s_mean"] / by[base]["t_s_mean"]
            print(f"{name} vs {base} {test}: {ratio:.2f}x")
    sizes = dict.fromkeys(bytes_per_token.values())
    if len(sizes) == 1:
        print(f"(weights read per decoded token: {next(iter(sizes)) / 1e9:.3f} GB)")
    else:
        print("(weights read per decoded token: " +
              ", ".join(f"{name} {n / 1e9:.3f} GB" for name, n in bytes_per_token.items()) + ")")


def plot(rows: list[dict], path: str, model: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tests = [t for t in dict.fromkeys(r["test"] for r in rows) if t != "ttft"]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(1, len(tests), figsize=(4 * len(tests), 3.5))
    axes = np.atleast_1d(axes)
    for ax, test in zip(axes, tests):
        vals = [next(r for r in rows if r["backend"] == b and r["test"] == test) for b in backends]
        ax.bar(backends, [v["t_s_mean"] for v in vals], yerr=[v["t_s_sd"] for v in vals], capsize=4)
        ax.set_title(test)
        ax.set_ylabel("tokens/s")
    fig.suptitle(model)
    fig.tight_layout()
    fig.savefig(path)
