"""`kvchat bench --resume`: time to first token when a prompt's prefix is already on disk
(core.kv_disk), each run a new `kvchat` process as a user starts it, against the first run of the
same prompt, against the new tokens alone, and against the llama.cpp peer (which has no disk cache
for a run: it prefills everything every time).

Two scenes:
- a document asked about twice: `kvchat run -f doc.txt "question"`, then again in a new process;
- a reopened chat: a conversation of about as many tokens, answered once (`kvchat batch`, one line
  of messages), then, in a new process, the same conversation with that answer and a new message.
  Its bar is the new message's tokens prefilled alone (a new process, disk cache off).

Every process gets a private, empty disk cache at the start of each round.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from app.bench import PEER, kvchat_process, random_prompt
from core import kv_disk
from core.tokenizer import Tokenizer
from models import registry
from models.gguf_file import open_model

DOC_TOKENS = 3000
QUESTION = "Which shelf holds the ledgers of the year 1871?"
NEW_MESSAGE = "Thanks. Now list the three oldest items you mentioned, one per line."
TOPICS = ["letters", "maps", "ledgers", "photographs", "logbooks", "contracts", "charts", "diaries"]


def paragraph(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (f"Shelf {i} of the harbour archive holds {topic} from the year {1840 + i}, catalogued by clerk "
            f"number {i * 7 % 31}; the {topic} were moved there after the flood of {1850 + i % 40}. ")


def text_of(tok: Tokenizer, n_tokens: int, start: int = 0) -> str:
    """Archive prose of about n_tokens tokens."""
    parts, n, i = [], 0, start
    while n < n_tokens:
        parts.append(paragraph(i))
        n += len(tok.encode(parts[-1]))
        i += 1
    return "".join(parts)


def conversation(tok: Tokenizer, n_tokens: int) -> list[dict]:
    """Six turns of about n_tokens in all, ending with a user message."""
    turns, share = [], n_tokens // 12
    for t in range(6):
        turns.append({"role": "user", "content": f"Tell me about part {t} of the archive. " + text_of(tok, share // 4, 40 * t)})
        turns.append({"role": "assistant", "content": text_of(tok, share * 7 // 4, 40 * t + 10)})
    turns.append({"role": "user", "content": QUESTION})
    return turns


def cmd_bench_resume(args) -> int:
    model = args.model or registry.DEFAULT_MODEL
    path = registry.resolve(model)
    tok = Tokenizer.from_gguf(open_model(path))
    common = ["-m", model, "--backend", "native", "--temperature", "0", "--ctx", str(args.ctx or 4096)]
    if args.threads:
        common += ["--threads", str(args.threads)]
    peer = None
    if PEER in (args.backend or PEER).split(","):
        from app.peer import PeerEngine
        peer = PeerEngine(str(path), args.ctx or 4096, args.threads, log=lambda line: print(line, file=sys.stderr))
    rows: dict[str, list[float]] = {}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        kv = Path(tmp, "kv")
        env = {**os.environ, kv_disk.ENV_DIR: str(kv), kv_disk.ENV_ON: "on"}
        doc = Path(tmp, "archive.txt")
        doc.write_text(text_of(tok, DOC_TOKENS))
        chat = conversation(tok, DOC_TOKENS)
        for _ in range(args.repetitions):
            kv_disk.clear(kv)
            run = ["run", "--json", "-n", "1", "-f", str(doc), QUESTION] + common
            first = json.loads(kvchat_process(run, env))["timings"]
            second = json.loads(kvchat_process(run, env))["timings"]
            if second["cache_disk_n"] == 0:
                raise RuntimeError("the second run restored nothing from disk")
            rows.setdefault("doc_first_ms", []).append(first["ttft_ms"])
            rows.setdefault("doc_second_ms", []).append(second["ttft_ms"])
            rows.setdefault("doc_tokens", []).append(first["prompt_n"] + first["cache_n"])
            rows.setdefault("doc_from_disk", []).append(second["cache_disk_n"])
            answer = _batch(tmp, chat, 16, common, env)
            reopened = _batch(tmp, chat + [{"role": "assistant", "content": answer["text"]},
                                           {"role": "user", "content": NEW_MESSAGE}], 1, common, env)["timings"]
            alone = _batch(tmp, [{"role": "user", "content": NEW_MESSAGE}], 1, common + ["--kv-disk", "off"], env)["timings"]
            rows.setdefault("chat_reopened_ms", []).append(reopened["ttft_ms"])
            rows.setdefault("chat_new_tokens", []).append(reopened["prompt_n"])
            rows.setdefault("chat_from_disk", []).append(reopened["cache_disk_n"])
            rows.setdefault("chat_alone_ms", []).append(alone["ttft_ms"])
            rows.setdefault("chat_alone_tokens", []).append(alone["prompt_n"])
            if peer is not None:
                ids = random_prompt(rng, int(rows["doc_tokens"][-1]), tok.n_vocab, tok.eog_ids)
                rows.setdefault("peer_doc_ms", []).append(peer.time(ids, 1)[1] * 1000)
    if peer is not None:
        peer.close()
    r = {k: statistics.fmean(v) for k, v in rows.items()}
    print(f"document of {r['doc_tokens']:.0f} tokens, asked twice (kvchat run -f, a new process each): "
          f"TTFT first {r['doc_first_ms']:.0f} ms, second {r['doc_second_ms']:.0f} ms "
          f"({r['doc_from_disk']:.0f} tokens from disk) = {r['doc_second_ms'] / r['doc_first_ms']:.1%} of the first")
    if peer is not None:
        print(f"  {PEER} (no disk cache: every run prefills): TTFT {r['peer_doc_ms']:.0f} ms; native first/peer "
              f"{r['doc_first_ms'] / r['peer_doc_ms']:.2f}x, native second/peer {r['doc_second_ms'] / r['peer_doc_ms']:.3f}x")
    print(f"reopened chat of {r['chat_from_disk']:.0f} tokens from disk + {r['chat_new_tokens']:.0f} new: TTFT "
          f"{r['chat_reopened_ms']:.0f} ms | the new message alone ({r['chat_alone_tokens']:.0f} tokens, a new "
          f"process): {r['chat_alone_ms']:.0f} ms | reopened/alone {r['chat_reopened_ms'] / r['chat_alone_ms']:.2f}x")
    if args.json:
        print(json.dumps({"test": "resume", **{k: round(v, 2) for k, v in r.items()}}))
    return 0


def _batch(tmp: str, messages: list[dict], n_gen: int, common: list[str], env: dict) -> dict:
    """One conversation through `kvchat batch` in a new process: its answer record."""
    src, dst = Path(tmp, "chat.jsonl"), Path(tmp, "answer.jsonl")
    src.write_text(json.dumps({"id": 0, "messages": messages}) + "\n")
    dst.unlink(missing_ok=True)
    kvchat_process(["batch", str(src), "-o", str(dst), "-n", str(n_gen)] + common, env)
    record = json.loads(dst.read_text().splitlines()[0])
    if "error" in record:
        raise RuntimeError(f"kvchat batch: {record['error']}")
    return record
