"""Continuous batching (core.batch, app.batch_cmd) on the real default model."""
from __future__ import annotations

import argparse
import json

import pytest

from core.types import SamplingParams
from core.batch import BatchRequest, BatchScheduler
from models.errors import BadInputError

MODEL = "qwen2.5-coder-0.5b-instruct"
PROMPTS = ["What is 2+2?", "Name three colors.", "def fib(n):", "Write a haiku about rust.", "Say hi."]
# a long prompt: its prefill rows run as a batch (llama.cpp's batched kernels), in the same steps as others' decode rows
LONG = ("Explain what this function does, briefly:\n\ndef merge(a, b):\n    out = []\n    i = j = 0\n"
        "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
        "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n")


@pytest.fixture(scope="module")
def engine(qwen_path):
    from core.engine import Engine
    e = Engine(MODEL, backend="native", n_ctx=512, threads=2)
    yield e
    e.close()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_greedy_batch_matches_each_alone(engine):
    params = greedy(12)
    prompts = PROMPTS[:3] + [LONG]
    assert len(engine.prompt_ids(LONG)) > 64
    alone = {}
    for i, p in enumerate(prompts):
        events = list(engine.generate(engine.prompt_ids(p), params))
        alone[i] = ([e.id for e in events if e.id >= 0], "".join(e.text for e in events), engine.backend.finish_reason)
    sched = BatchScheduler(engine.backend, parallel=3)
    got = {r.id: r for r in sched.results(BatchRequest(i, engine.prompt_ids(p), params)
                                          for i, p in enumerate(prompts))}
    for i, (tokens, text, reason) in alone.items():
        assert got[i].tokens == tokens, prompts[i]
        assert got[i].text == text
        assert got[i].finish_reason == reason
        assert got[i].timings.prompt_n + got[i].timings.cache_n == len(engine.prompt_ids(prompts[i]))
    # the chat template's shared system prefix is reused from registered blocks by later requests
    assert max(r.timings.cache_n for r in got.values()) >= 16


def test_requests_join_in_flight(engine):
    events = []
    sched = BatchScheduler(engine.backend, parallel=2)
    reqs = [BatchRequest(i, engine.prompt_ids(p), greedy(2 if i == 0 else 6)) for i, p in enumerate(PROMPTS)]
    for r in sched.results(reqs, on_start=lambda req: events.append(("start", req.id))):
        events.append(("end", r.id))
    assert sorted(e[1] for e in events if e[0] == "end") == list(range(5))
    # request 2 starts as soon as request 0 leaves, while request 1 (the first batch) still runs
    assert events.index(("end", 0)) < events.index(("start", 2)) < events.index(("end", 1))
    assert all(sum(1 for e in events[:k] if e[0] == "start") - sum(1 for e in events[:k] if e[0] == "end") <= 2
               for k in range(len(events) + 1))


def test_stop_string_and_bad_params(engine):
    sched = BatchScheduler(engine.backend, parallel=4)
    ids = engine.prompt_ids("What is 2+2?")
    alone = "".join(e.text for e in engine.generate(ids, greedy(12)))
    stop = alone.split()[1]
    res = {r.id: r for r in sched.results([BatchRequest("s", ids, greedy(12, stop=(stop,))),
                                           BatchRequest("bad", ids, SamplingParams(top_p=0)),
                                           BatchRequest("long", list(range(600)), greedy(4))])}
    assert res["s"].finish_reason == "stop" and stop not in res["s"].text
    assert alone.startswith(res["s"].text)
    assert "top-p" in res["bad"].error
    assert "context" in res["long"].error


def _args(tmp_path, *extra):
    from app.batch_cmd import add_batch_parser
    parser = argparse.ArgumentParser()
    add_batch_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "-m", MODEL,
                              "--ctx", "512", "--threads", "2", "--temperature", "0", "--max-tokens", "6", *extra])


def test_cmd_batch_errors_and_resume(engine, tmp_path):
    from app.batch_cmd import cmd_batch
    lines = [json.dumps({"id": "a", "prompt": "What is 2+2?"}),
             "{not json",
             json.dumps({"prompt": "no id"}),
             json.dumps({"id": "b", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}),
             json.dumps({"id": "c", "prompt": "Name three colors.", "temperature": "hot"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert cmd_batch(_args(tmp_path, "--parallel", "2")) == 0
    recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r for r in recs if r["id"] is not None}
    assert set(by_id) == {"a", "b", "c"}
    no_id = sorted((r["line"], r["error"]) for r in recs if r["id"] is None)   # no made-up ids
    assert [n for n, _ in no_id] == [2, 3] and "not JSON" in no_id[0][1] and "missing id" in no_id[1][1]
    assert {r["id"]: r["line"] for r in recs if r["id"] is not None} == {"a": 1, "b": 4, "c": 5}
    assert "temperature" in by_id["c"]["error"]
    assert by_id["b"]["timings"]["predicted_n"] <= 3 and by_id["b"]["finish_reason"] in ("stop", "length")
    ids = engine.prompt_ids("What is 2+2?")
    assert by_id["a"]["tokens"] == [e.id for e in engine.generate(ids, greedy(6)) if e.id >= 0]
    assert set(by_id["a"]["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "ttft_ms", "cache_n"}
    # resume after the user fixed line "c", added "d", and a run died mid-record: the answers already
    # written stay as they were and do not run again; the failed ids and the cut record run again
    lines[4] = json.dumps({"id": "c", "prompt": "Name three colors."})
    lines.append(json.dumps({"id": "d", "prompt": "Say hi."}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    answered = [r for r in recs if "error" not in r]
    with open(tmp_path / "out.jsonl", "a") as f:
        f.write('{"id": "d", "te')
    assert cmd_batch(_args(tmp_path)) == 0
    recs2 = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert recs2[:len(answered)] == answered
    rerun = {r["id"] if r["id"] is not None else r["line"]: r for r in recs2[len(answered):]}
    assert set(rerun) == {2, 3, "c", "d"} and len(recs2) == len(answered) + 4
    assert "error" in rerun[2] and "error" in rerun[3] and rerun["c"]["tokens"] and rerun["d"]["tokens"]


def test_unsupported_backend(engine, tmp_path, capsys):
    """`kvchat batch --backend llama.cpp` is refused by the parser (exit 2, the engines that batch
    named), and the scheduler itself refuses a backend that does not batch."""
    from core.batch import BatchScheduler
    from core.llamacpp_backend import LlamaCppBackend
    with pytest.raises(SystemExit) as e:
        _args(tmp_path, "--backend", "llama.cpp")
    assert e.value.code == 2 and "'native', 'torch'" in capsys.readouterr().err
    llama = LlamaCppBackend(engine.gguf, engine.tokenizer, 256, 2)
    with pytest.raises(BadInputError, match="llama.cpp backend does not batch"):
        BatchScheduler(llama)
    llama.close()


def test_live_requests_stream_join_in_flight_and_cancel(engine):
    """serve(): requests that arrive while another runs join it; take is asked to wait only when no
    sequence runs; each request streams its text as it goes; a cancelled one ends at the next step
    (finish_reason cancelled) while the others go on."""
    import threading
    from core.batch import END
    sched = BatchScheduler(engine.backend, parallel=4)
    streamed: dict[int, list[str]] = {0: [], 1: [], 2: []}
    reqs = [BatchRequest(i, engine.prompt_ids(p), greedy(30), cancel=threading.Event())
            for i, p in enumerate(["Count from 1 to 20.", "Name three colors.", "Write a long poem about the sea."])]
    pending = [reqs[0]]
    blocks: list[bool] = []
    results = {}

    def on_text(i):
        def add(text):
            streamed[i].append(text)
            if i == 0 and len(streamed[0]) == 2:        # two more arrive while request 0 runs
                pending.extend(reqs[1:])
            if i == 2 and len(streamed[2]) == 3:
                reqs[2].cancel.set()
        return add
    for r in reqs:
        r.on_text = on_text(r.id)

    def take(block):
        blocks.append(block)
        return pending.pop(0) if pending else END if block else None
    sched.serve(take, lambda r: results.__setitem__(r.id, r))
    assert sorted(results) == [0, 1, 2]
    assert blocks[0] is True and blocks[-1] is True and True not in blocks[1:-1]
    assert results[2].finish_reason == "cancelled" and len(results[2].tokens) == 3
    for i in (0, 1):
        assert results[i].finish_reason in ("stop", "length") and len(results[i].tokens) > 3
    for i, r in results.items():
        assert "".join(streamed[i]) == r.text and r.text
