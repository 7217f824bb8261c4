"""`kvchat batch prompts.jsonl -o answers.jsonl`: many prompts through one model with continuous
batching (core.batch) on the native engine.

Input, one JSON object a line: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]},
with optional sampling fields (every SamplingParams field but logit_bias and banned: temperature,
top_k, top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed,
max_tokens, stop) over the command line's defaults. Output, one line per id, written and flushed as soon as it
finishes: {"id", "line", "text", "tokens", "finish_reason", "timings"}, or {"id", "line", "error"} for
a line that cannot run ("id": null when the line has none; "line" is its 1-based number in the input). Ids already answered in the output file
are skipped, so an interrupted run resumes where it stopped; ids that failed run again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterator

from app.args import add_kv_disk_args, add_sampling_args, kv_disk_from_args, sampling_from_args, sampling_from_json
from models.errors import BadInputError



def add_batch_parser(subparsers) -> argparse.ArgumentParser:
    from core.batch import DEFAULT_PARALLEL
    from core.engine import DEFAULT_CTX
    from models.registry import DEFAULT_MODEL
    p = subparsers.add_parser("batch", help="many prompts from a JSONL file, continuously batched")
    p.add_argument("input", help="JSONL file of {id, prompt | messages, sampling fields...}; '-' reads stdin")
    p.add_argument("-o", "--output", required=True, help="JSONL answers (appended; ids already answered are skipped, failed ones rerun)")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=f"registry name or path to a .gguf (default: {DEFAULT_MODEL})")
    p.add_argument("--backend", choices=("native", "torch", "openai"), default="native",
                   help="inference engine: native (default) or torch (the engines that batch), or openai: a server "
                        "at --base-url, sent up to --parallel requests at once")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="with --backend openai: an OpenAI-compatible server's API root, e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="with --backend openai: the server's API key (default: $OPENAI_API_KEY)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the torch engine runs (see kvchat run --help)")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"context per sequence in tokens (default: {DEFAULT_CTX})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--parallel", type=int, default=DEFAULT_PARALLEL,
                   help=f"most sequences decoded together (default: {DEFAULT_PARALLEL})")
    p.add_argument("--no-chat", action="store_true", help="send raw prompts, without the chat template")
    add_kv_disk_args(p)
    add_sampling_args(p)   # the same sampling flags as `run`; a line's own fields override them
    return p


def _default_params(args):
    params = sampling_from_args(args)
    if params.banned:   # backing off needs a per-sequence rollback the batch scheduler does not do
        raise BadInputError("--ban is not supported by kvchat batch; use kvchat run")
    return params


def resume_output(path: Path) -> set[str]:
    """Ids (as JSON text, so 1 and "1" differ) of the answers already in the output file, which a
    resumed run skips. Error records and a last line cut short by an interruption are taken out of
    the file (rewritten whole, then renamed over it, so a crash keeps the old file) and their ids run
    again: a line the user has fixed since gets its answer, and every later record starts on a line
    of its own."""
    done: set[str] = set()
    if not path.exists():
        return done
    raw = path.read_bytes()
    keep: list[str] = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "id" in rec and "error" not in rec:
            done.add(json.dumps(rec["id"]))
            keep.append(line)
    text = "".join(line + "\n" for line in keep)
    if text.encode("utf-8") != raw:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return done


def parse_lines(lines, engine, base, chat: bool
                ) -> Iterator[tuple[object, int, list[int] | None, object, str | None]]:
    """(id, line number, prompt ids, params, error) per non-blank line; id None when the line has none."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield None, n, None, None, f"line {n}: not JSON ({e.msg})"
            continue
        if not isinstance(obj, dict):
            yield None, n, None, None, f"line {n}: not a JSON object"
            continue
        rid = obj.get("id")
        if rid is None or isinstance(rid, (dict, list)):
            yield None, n, None, None, f"line {n}: missing id" + (" (it must be a string or a number)" if rid is not None else "")
            continue
        try:
            params = sampling_from_json(obj, base)   # the line's fields over the command line's
            if isinstance(obj.get("messages"), list) and obj["messages"]:
                msgs = obj["messages"]
                if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in msgs):
                    raise BadInputError("each message needs a role and a content string")
                msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
            elif isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
                msgs = [{"role": "user", "content": obj["prompt"]}]
            else:
                raise BadInputError("needs a non-empty prompt or messages")
            ids = engine.prompt_ids(msgs, chat)
        except BadInputError as e:
            yield rid, n, None, None, str(e)
            continue
        yield rid, n, ids, params, None


def cmd_batch(args) -> int:
    from app.progress import stderr_progress
    from core.batch import BatchRequest, BatchResult, BatchScheduler
    from core.engine import Engine

    from app.cli import remote_args
    remote = remote_args(args)
    if args.backend not in ("native", "openai"):
        raise BadInputError(f"batch runs on the native backend only (not {args.backend})")
    if args.parallel < 1:
        raise BadInputError("--parallel must be >= 1")
    base = _default_params(args)
    if args.input == "-":
        lines = sys.stdin.read().splitlines()
    else:
        src = Path(args.input)
        if not src.is_file():
            raise BadInputError(f"no such input file: {args.input}")
        try:
            lines = src.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise BadInputError(f"{args.input} is not valid UTF-8 (byte {e.start})") from None
    out_path = Path(args.output)
    skip = resume_output(out_path)
    if remote:
        return _batch_remote(args, remote, base, lines, out_path, skip)
    with stderr_progress() as progress:
        engine = Engine(args.model, backend=args.backend, n_ctx=args.ctx, threads=args.threads, progress=progress,
                        device=args.device if args.backend == "torch" else "cpu", **kv_disk_from_args(args))
    chat = not args.no_chat and engine.has_chat_template
    if not args.no_chat and not engine.has_chat_template:
        sys.stderr.write(f"kvchat: note: {engine.model_name} has no chat template; using plain completion\n")
    parsed = [p for p in parse_lines(lines, engine, base, chat) if p[0] is None or json.dumps(p[0]) not in skip]
    scheduler = BatchScheduler(engine.backend, args.parallel)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=Console(file=sys.stderr))
    n_err = n_tok = 0
    import time
    t0 = time.perf_counter()
    with open(out_path, "a", encoding="utf-8") as out, bar:
        task = bar.add_task("batch", total=len(parsed), rate="")

        def write(res: BatchResult) -> None:
            nonlocal n_err, n_tok
            out.write(json.dumps(res.as_record(), ensure_ascii=False) + "\n")
            out.flush()
            n_err += res.error is not None
            n_tok += len(res.tokens)
            rate = f"{n_tok / max(time.perf_counter() - t0, 1e-9):.1f} tok/s"
            bar.update(task, advance=1, rate=rate)

        def requests():
            for rid, line, ids, params, err in parsed:
                if err is not None:
                    write(BatchResult(rid, error=err, line=line))
                else:
                    yield BatchRequest(rid, ids, params, line=line)

        for res in scheduler.results(requests()):
            write(res)
    dt = time.perf_counter() - t0
    sys.stderr.write(f"[{len(parsed)} requests ({len(skip)} already done, {n_err} errors) | {n_tok} tokens in "
                     f"{dt:.1f} s, {n_tok / dt if dt > 0 else 0:.1f} tok/s | {scheduler.steps} steps]\n")
    return 0


def _batch_remote(args, remote: dict, base, lines: list[str], out_path: Path, skip: set[str]) -> int:
    """kvchat batch --backend openai: each line one streamed request to the server, up to --parallel
    at once (threads); answers written as they finish, in kvchat batch's format (tokens: [], the
    server gives no ids). A request the server refuses is that line's error record."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor, as_completed
    from core.batch import BatchResult
    from core.engine import open_engine
    from core.remote_engine import RemoteBackend

    engine = open_engine(args.model, backend="openai", **remote)
    chat = not args.no_chat
    parsed = [p for p in parse_lines(lines, engine, base, chat) if p[0] is None or json.dumps(p[0]) not in skip]
    lock = threading.Lock()
    n_err = n_tok = 0
    t0 = time.perf_counter()

    def one(rid, line, prompt, params) -> BatchResult:
        state = RemoteBackend(engine.n_ctx)
        try:
            text = "".join(e.text for e in engine.generate(prompt, params, backend=state))
        except BadInputError as e:
            return BatchResult(rid, error=str(e), line=line)
        return BatchResult(rid, text, [], state.finish_reason, state.timings, line=line)

    with open(out_path, "a", encoding="utf-8") as out:
        def write(res: BatchResult) -> None:
            nonlocal n_err, n_tok
            with lock:
                out.write(json.dumps(res.as_record(), ensure_ascii=False) + "\n")
                out.flush()
                n_err += res.error is not None
                n_tok += res.timings.predicted_n

        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            futures = []
            for rid, line, prompt, params, err in parsed:
                if err is not None:
                    write(BatchResult(rid, error=err, line=line))
                else:
                    futures.append(pool.submit(one, rid, line, prompt, params))
            for future in as_completed(futures):
                write(future.result())
    engine.close()
    dt = time.perf_counter() - t0
    sys.stderr.write(f"[{len(parsed)} requests ({len(skip)} already done, {n_err} errors) | {n_tok} tokens in "
                     f"{dt:.1f} s, {n_tok / dt if dt > 0 else 0:.1f} tok/s | {engine.base_url}]\n")
    return 0
