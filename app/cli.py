"""kvchat's command line: chat (TUI), run, tokenize, models, bench.

Exit codes: 0 ok, 2 bad input (one line on stderr, no traceback), 130 interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading

import core  # noqa: F401  (first, before anything imports numba: it sets numba's compile cache)

from models.errors import BadInputError  # noqa: E402
from app.args import (FORMAT_OPTIONS, add_kv_disk_args, add_sampling_args, kv_disk_from_args, sampling_from_args,  # noqa: E402
                      set_default_sampling_args, size_arg)

EXIT_OK, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 2, 130


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str):
        sys.stderr.write(f"kvchat: error: {message} (see: {self.prog} --help)\n")
        raise SystemExit(EXIT_BAD_INPUT)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from core.engine import BACKEND_NAMES, DEFAULT_CTX, DEVICE_NAMES
    from models.registry import DEFAULT_MODEL
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=f"registry name or path to a .gguf (default: {DEFAULT_MODEL})")
    p.add_argument("--backend", choices=BACKEND_NAMES, default=None,
                   help="inference engine (default: auto: kvchat's own engine for every file it runs, llama.cpp "
                        "for the rest; native: kvchat's CPU engine; torch: its GPU engine; openai: a server at --base-url)")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="with --backend openai: an OpenAI-compatible server's API root, e.g. http://127.0.0.1:8080/v1 "
                        "(vLLM, llama-server, Ollama, kvchat serve); -m names the model it serves")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="with --backend openai: the server's API key (default: $OPENAI_API_KEY)")
    p.add_argument("--device", choices=DEVICE_NAMES, default="auto",
                   help="auto: CUDA when there is a GPU, else the CPU; cuda: the torch engine on the GPU; "
                        "cpu: the CPU (--backend torch --device cpu runs the GPU engine in Triton's interpreter)")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"context length in tokens (default: {DEFAULT_CTX})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    add_kv_disk_args(p)


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=("off", "lookup", "draft"), default="off",
                   help="speculative decoding (native backend): lookup drafts from n-grams of the prompt and "
                        "output; draft uses a smaller model with the same vocabulary (--draft-model)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model for --speculative draft: registry name or path "
                        "(e.g. qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct)")
    p.add_argument("--draft-n", type=int, default=None,
                   help="most draft tokens per verification pass (default: 7 for lookup, whose drafts grow "
                        "after full accepts and shrink after a miss; 7 for draft, which stops where the draft model is unsure)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvchat", description="Local LLM chat on GGUF models, with kvchat's own engine.")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)

    chat = sub.add_parser("chat", help="open the chat (the default when no command is given)")
    _add_model_args(chat)
    _add_speculative_args(chat)
    add_sampling_args(chat, FORMAT_OPTIONS)     # --json-schema / --grammar for every reply of the session

    run = sub.add_parser("run", help="one-shot generation; text streams to stdout")
    run.add_argument("prompt", nargs="?", default=None, help="the prompt; '-' or absent reads stdin (when not a TTY)")
    _add_model_args(run)
    add_sampling_args(run)
    run.add_argument("--system", default=None, help="system prompt")
    run.add_argument("--no-chat", action="store_true", help="send the raw prompt, without the chat template")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    run.add_argument("-f", "--file", action="append", default=[], dest="files", metavar="FILE",
                     help="attach a UTF-8 text file: its text goes into the message, under a header with its "
                          "name, before the prompt (repeatable)")
    _add_speculative_args(run)

    tok = sub.add_parser("tokenize", help="print the token ids and pieces of a text")
    tok.add_argument("-m", "--model", default=None, help="registry name or path to a .gguf")
    tok.add_argument("text", nargs="?", default=None, help="the text; '-' or absent reads stdin")
    tok.add_argument("--json", action="store_true", help='print {"tokens": [...], "pieces": [...]}')
    tok.add_argument("--special", action="store_true", help="parse special tokens written in the text")
    tok.add_argument("--bos", action="store_true", help="add the BOS token (when the model has one)")

    models = sub.add_parser("models", help="the model registry: list | pull NAME | info NAME_OR_PATH | path NAME")
    msub = models.add_subparsers(dest="models_command", parser_class=OneLineParser, required=True)
    msub.add_parser("list", help="registry models and whether they are downloaded")
    pull = msub.add_parser("pull", help="download a registry model (verified by SHA-256)")
    pull.add_argument("name")
    info = msub.add_parser("info", help="architecture, parameters, tensor types, context, template, size")
    info.add_argument("name", help="registry name or path to a .gguf")
    info.add_argument("--json", action="store_true")
    path = msub.add_parser("path", help="where a registry model is stored")
    path.add_argument("name")

    bench = sub.add_parser("bench", help="llama-bench style benchmark: pp, tg, TTFT, GB/s; backends interleaved")
    bench.add_argument("-m", "--model", default=None, help="registry name or path (default: the default model)")
    bench.add_argument("--backend", default=None,
                       help="one or several backends, comma-separated (default: native and llama.cpp, and torch "
                            "when there is a CUDA device)")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="where the torch backend runs (the others run on the CPU)")
    bench.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for pp (default: 512)")
    bench.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for tg (default: 128)")
    bench.add_argument("-r", "--repetitions", type=int, default=3, help="rounds (default: 3)")
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--ctx", type=int, default=None, help="context (default: enough for the test)")
    bench.add_argument("-d", "--depth", type=int, default=0,
                       help="tg after this many tokens already in the context (llama-bench's -d; default: 0)")
    bench.add_argument("--json", action="store_true", help="one JSON row per (backend, test)")
    bench.add_argument("--plot", default=None, metavar="PNG", help="also write a bar chart")
    bench.add_argument("--multiturn", action="store_true",
                       help="TTFT of a 20-token message after 1500 tokens of history: reused vs alone vs recomputed")
    bench.add_argument("--resume", action="store_true",
                       help="TTFT from the disk KV cache, a new kvchat process each run: a 3,000-token document "
                            "asked about twice, and a reopened 3,000-token chat against its new message alone")
    bench.add_argument("--speculative", action="store_true",
                       help="decode speed with prompt-lookup speculation (and --draft-model) vs plain, "
                            "on a code-rewrite prompt")
    bench.add_argument("--draft-model", default=None,
                       help="with --speculative: also time this draft model (e.g. qwen2.5-coder-0.5b-instruct)")
    bench.add_argument("--draft-n", type=int, default=None,
                       help="with --speculative: most draft tokens per check (default: 7)")
    bench.add_argument("--json-schema", action="store_true",
                       help="decode speed with a JSON schema (constrained decoding) vs without, same prompt, "
                            "native backend")
    bench.add_argument("--batch", type=int, default=0, metavar="N",
                       help="N prompts x up to -n tokens (greedy): continuous batching (native) vs each backend "
                            "one prompt at a time, in-process; batched tokens must equal one-by-one tokens")
    bench.add_argument("--parallel", type=int, default=16, help="with --batch: sequences per step (default: 16)")
    bench.add_argument("--processes", action="store_true",
                       help="with --batch: also each prompt through its own `kvchat run` process against one "
                            "`kvchat batch` process (wall time, model loads included)")

    cache = sub.add_parser("cache", help="the disk KV cache: stats | clear | on | off | max SIZE")
    csub = cache.add_subparsers(dest="cache_command", required=True, parser_class=OneLineParser)
    csub.add_parser("stats", help="where it is, how many blocks, their size and the cap")
    csub.add_parser("clear", help="delete every block")
    csub.add_parser("on", help="keep KV blocks on disk by default (the initial setting)")
    csub.add_parser("off", help="do not, unless a command says --kv-disk on")
    cmax = csub.add_parser("max", help="the size cap, e.g. 4G (least recently used blocks are deleted past it)")
    cmax.add_argument("size")

    from app.batch_cmd import add_batch_parser
    from app.export import add_export_parser
    add_batch_parser(sub)
    add_export_parser(sub)
    from app.serve import add_serve_parser
    add_serve_parser(sub, _add_model_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = dispatch(args)
    except BadInputError as e:
        sys.stdout.flush()
        sys.stderr.write(f"kvchat: error: {e}\n")
        code = EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.write("\nkvchat: interrupted\n")
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OK
    return code


def dispatch(args) -> int:
    command = args.command or "chat"
    if command == "chat":
        return cmd_chat(args)
    if command == "run":
        return cmd_run(args)
    if command == "tokenize":
        return cmd_tokenize(args)
    if command == "models":
        return cmd_models(args)
    if command == "cache":
        return cmd_cache(args)
    if command == "bench":
        from app.bench import cmd_bench
        return cmd_bench(args)
    if command == "batch":
        from app.batch_cmd import cmd_batch
        return cmd_batch(args)
    if command == "serve":
        from app.serve import cmd_serve
        return cmd_serve(args)
    if command == "export":
        from app.export import cmd_export
        return cmd_export(args)
    raise BadInputError(f"unknown command {command}")


def read_text_arg(value: str | None, what: str) -> str:
    """The argument, or stdin when it is '-' or absent and stdin is not a terminal. Strict UTF-8."""
    if value is not None and value != "-":
        return value
    if value is None and sys.stdin.isatty():
        raise BadInputError(f"no {what} given (pass it as an argument or pipe it on stdin)")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInputError(f"stdin is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def remote_args(args) -> dict:
    """--base-url and --api-key for open_engine; each is an error without --backend openai (and
    --backend openai without --base-url)."""
    backend, base_url = getattr(args, "backend", None), getattr(args, "base_url", None)
    if base_url is not None and backend != "openai":
        raise BadInputError("--base-url goes with --backend openai")
    if backend == "openai" and not base_url:
        raise BadInputError("--backend openai needs --base-url URL (e.g. http://127.0.0.1:8080/v1)")
    if getattr(args, "api_key", None) is not None and backend != "openai":
        raise BadInputError("--api-key goes with --backend openai")
    return {"base_url": base_url, "api_key": getattr(args, "api_key", None)} if backend == "openai" else {}


def load_engine(args, model: str | None = None):
    from app.progress import stderr_progress
    from core.engine import open_engine
    remote = remote_args(args)
    if remote:
        return open_engine(model or args.model, backend="openai", **remote)
    with stderr_progress() as progress:
        return open_engine(model or args.model, backend=getattr(args, "backend", None), n_ctx=args.ctx,
                           threads=args.threads, progress=progress, device=getattr(args, "device", "auto"),
                           **kv_disk_from_args(args))


@contextlib.contextmanager
def ctrl_c_cancels(cancel: threading.Event):
    """While a reply streams, the first Ctrl-C sets `cancel`: generation stops at its next token
    and what streamed is kept; a second one interrupts at once (KeyboardInterrupt), as it must for a
    stalled `--backend openai` read (Python retries a read after a handler that returns). Why a flag
    and not Python's KeyboardInterrupt: in the full suite a `--backend llama.cpp` reply twice went on
    streaming 60 s after SIGINT; the likely cause, not proven, is the exception raised inside one of
    llama.cpp's Python callbacks (its log hook) and swallowed there. A flag cannot be lost."""
    def handler(_signum, _frame):
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_run(args) -> int:
    from core.attachments import check_message_fits, compose_message, read_attachment
    from core.chat_session import fit_prompt
    from core.types import SpeculativeConfig
    params = sampling_from_args(args)
    speculative = SpeculativeConfig(args.speculative, args.draft_n, args.draft_model).validate()
    prompt = read_text_arg(args.prompt, "prompt")
    if not prompt.strip():
        raise BadInputError("the prompt is empty")
    attachments = [read_attachment(path) for path in getattr(args, "files", [])]   # (before the model loads)
    prompt = compose_message(prompt, attachments)
    if remote_args(args):
        if speculative.method != "off":
            raise BadInputError("--speculative runs on the local engines, not --backend openai")
        if params.banned:
            raise BadInputError("--ban runs on the local engines, not --backend openai")
    engine = load_engine(args)
    chat = not args.no_chat
    if chat and not engine.has_chat_template:
        sys.stderr.write(f"kvchat: note: {engine.model_name} has no chat template; using plain completion\n")
        chat = False
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
    if not chat and args.system:
        messages = [{"role": "user", "content": args.system + "\n\n" + prompt}]
    check_message_fits(engine, messages, attachments, chat=chat)
    ids, truncated = fit_prompt(engine, messages, chat=chat)
    cancel = threading.Event()
    pieces, tokens = [], []
    interrupted = False
    failed: BadInputError | None = None
    try:
        with ctrl_c_cancels(cancel):
            for event in engine.generate(ids, params, cancel, speculative):
                if event.id >= 0:
                    tokens.append(event.id)
                if event.text:
                    pieces.append(event.text)
                    if not args.json:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
        interrupted = cancel.is_set()
    except KeyboardInterrupt:
        interrupted = True
        engine.backend.finish_reason = "cancelled"
    except BadInputError as e:   # a server failed mid-reply (--backend openai): what arrived, then the error
        failed = e
    backend = engine.backend
    if args.json:
        print(json.dumps({
            **({"error": str(failed)} if failed is not None else {}),
            "text": "".join(pieces), "tokens": tokens, "finish_reason": backend.finish_reason,
            "timings": backend.timings.as_dict(), "model": engine.model_name, "backend": engine.backend_name,
            "device": engine.device, "truncated": truncated,
            **({"speculative": {"method": speculative.method, "drafted": backend.stats.spec_drafted,
                                "accepted": backend.stats.spec_accepted}} if speculative.method != "off" else {}),
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    if failed is not None:
        if pieces:
            sys.stderr.write(f"kvchat: the reply above is partial ({len(''.join(pieces))} characters)\n")
        raise failed
    spec = ""
    if speculative.method != "off":
        drafted, accepted = backend.stats.spec_drafted, backend.stats.spec_accepted
        spec = f" | speculative {speculative.method}: accepted {accepted}/{drafted} drafts" + \
            (f" ({100 * accepted / drafted:.0f}%)" if drafted else "")
    from core.remote_engine import is_remote, summary
    timings = summary(backend.timings) if is_remote(engine) else backend.timings.summary()
    sys.stderr.write(f"[{timings}{spec} | {backend.finish_reason}]\n")
    if interrupted:
        sys.stderr.write("kvchat: interrupted\n")
        return EXIT_INTERRUPTED
    return EXIT_OK


def cmd_tokenize(args) -> int:
    from core.tokenizer import Tokenizer
    from models import registry
    from models.gguf_file import open_model
    text = read_text_arg(args.text, "text")
    from app.progress import stderr_progress
    with stderr_progress() as progress:
        path = registry.resolve(args.model or registry.DEFAULT_MODEL, progress)
    tok = Tokenizer.from_gguf(open_model(path))
    ids = tok.encode(text, add_bos=args.bos, special=args.special)
    pieces = [tok.piece(i) for i in ids]
    if args.json:
        print(json.dumps({"tokens": ids, "pieces": pieces}, ensure_ascii=False))
    else:
        for i, piece in zip(ids, pieces):
            print(f"{i:>8} {piece!r}")
    return EXIT_OK


def cmd_models(args) -> int:
    from models import registry
    from models.gguf_file import open_model
    sub = args.models_command
    if sub == "list":
        for m in registry.REGISTRY.values():
            mark = "*" if m.name == registry.DEFAULT_MODEL else " "
            state = "downloaded" if registry.is_pulled(m.name) else "not downloaded"
            print(f"{mark} {m.name:<30} {m.size / 1e6:>7.0f} MB  {state:<15} {m.description}")
        return EXIT_OK
    if sub == "path":
        print(registry.model_path(args.name))
        return EXIT_OK
    from app.progress import stderr_progress
    if sub == "pull":
        registry.lookup(args.name)
        with stderr_progress() as progress:
            path = registry.pull(args.name, progress)
        print(path)
        return EXIT_OK
    if sub == "info":
        with stderr_progress() as progress:
            path = registry.resolve(args.name, progress)
        g = open_model(path)
        info = g.info()
        if args.json:
            print(json.dumps(info))
        else:
            print(f"path            {info['path']}")
            print(f"architecture    {info['architecture']}")
            print(f"name            {info['name']}")
            print(f"parameters      {info['parameters']:,} ({info['parameters'] / 1e9:.2f} B)")
            if info["experts"]:
                n_expert, n_used = info["experts"]
                print(f"experts         {n_expert}, {n_used} per token ({info['active_parameters'] / 1e9:.2f} B "
                      "parameters per token)")
            print(f"tensor types    " + ", ".join(f"{t}: {n}" for t, n in info["tensor_types"].items()))
            print(f"context length  {info['context_length']}")
            print(f"chat template   {'yes' if info['chat_template'] else 'no (completion only)'}")
            from core.tokenizer import vocabulary_lacks
            vocab_lacks = vocabulary_lacks(g.get("tokenizer.ggml.model"), g.get("tokenizer.ggml.pre"))
            print("tokenizer       " + (f"llama.cpp's (kvchat's does not split {vocab_lacks} yet)" if vocab_lacks
                                        else "kvchat's (llama.cpp's ids, tested)"))
            print(f"file size       {info['file_size']:,} bytes ({info['file_size'] / 1e6:.1f} MB)")
            lacks = info["kvchat_engine_lacks"]
            on_gpu = "torch on a GPU" if not info["torch_engine_lacks"] else "llama.cpp on a GPU"
            print("engine          " + (f"llama.cpp (kvchat's engine does not run {lacks} yet)" if lacks
                                        else f"kvchat's own (native on the CPU, {on_gpu})"))
            if not lacks:
                from kernels.cpu.isa import BF16_ENV, ISA_ENV, PREFETCH_ENV, bf16_dot, chosen, prefetch_target, variant
                print(f"CPU kernels     {variant()} ({ISA_ENV}={chosen()}; every variant computes the same bits), "
                      f"prefetch into {prefetch_target()} ({PREFETCH_ENV}), BF16 products on {bf16_dot()} ({BF16_ENV})")
                from models.gguf_file import WEIGHTS_ENV, weights_in_memory
                print("weights         " + ("read into memory" if weights_in_memory(info["file_size"]) else "mapped from their files")
                      + f" ({WEIGHTS_ENV})")
            slow, gpu_lacks = info["torch_dequantized"], info["torch_engine_lacks"]
            print("torch engine    " + (f"does not run {gpu_lacks} yet" if gpu_lacks else
                                        f"dequantizes {', '.join(slow)} at load (no Triton GEMV kernel)" if slow
                                        else "reads every quantized matrix in place"))
        return EXIT_OK
    raise BadInputError(f"unknown models command {sub}")


def cmd_cache(args) -> int:
    from core import kv_disk
    sub = args.cache_command
    if sub == "stats":
        s = kv_disk.stats()
        state = "on" if kv_disk.enabled_by_default() else "off"
        print(f"disk KV cache   {state}, {s['dir']}")
        print(f"blocks          {s['blocks']:,} ({s['bytes'] / 2**20:,.1f} MiB of {s['max_bytes'] / 2**20:,.0f} MiB)")
    elif sub == "clear":
        print(f"deleted {kv_disk.clear():,} blocks")
    elif sub in ("on", "off"):
        kv_disk.save_setting(kv_disk=sub == "on")
        print(f"disk KV cache {sub}")
    elif sub == "max":
        size = size_arg(args.size, "cache max")
        kv_disk.save_setting(kv_disk_max=size)
        removed = kv_disk.evict(kv_disk.kv_dir(), size)
        print(f"disk KV cache cap {size / 2**20:,.0f} MiB" + (f"; deleted {removed:,} blocks" if removed else ""))
    return EXIT_OK


def cmd_chat(args) -> int:
    if not hasattr(args, "model"):   # bare `kvchat`: chat with the defaults
        args = build_parser().parse_args(["chat"])
    if remote_args(args) and args.speculative != "off":
        raise BadInputError("--speculative runs on the local engines, not --backend openai")
    try:
        from app.tui.app import run_tui
    except ImportError:
        run_tui = None
    if run_tui is not None and sys.stdin.isatty() and sys.stdout.isatty():
        return run_tui(args)
    # No terminal to draw on (or the TUI is not installed): one greeting, so the command still works.
    args.prompt, args.system, args.no_chat, args.json = "Hello! Introduce yourself in one sentence.", None, False, False
    set_default_sampling_args(args, max_tokens=128)
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
