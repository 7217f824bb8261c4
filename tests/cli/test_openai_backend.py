"""`--backend openai`: kvchat as the client of an OpenAI-compatible server. The server here is a
third party's: llama-cpp-python's own (`python -m llama_cpp.server`, its [server] extra) on the
default registry model, a real subprocess on a free port. kvchat run, batch and the chat (Textual's
Pilot) talk to it over HTTP as a user's would; the failures are real too (a closed port, a wrong
key, a prompt over the server's context, the server killed mid-reply)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import run_kvchat

pytestmark = pytest.mark.real_model   # a server subprocess on a registry model, kvchat in subprocesses

KEY = "test-key"
ALIAS = "qwen-remote"
QWEN_EOS = (151643, 151645)      # <|endoftext|>, <|im_end|>: banned where a reply must not end early


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(model_path, port: int) -> subprocess.Popen:
    """llama-cpp-python's server on `port`, once /v1/models answers. Requests queue instead of
    interrupting each other (batch sends several at once)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path), "--port", str(port),
         "--host", "127.0.0.1", "--n_ctx", "2048", "--api_key", KEY, "--model_alias", ALIAS,
         "--interrupt_requests", "False", "--n_threads", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                         headers={"Authorization": f"Bearer {KEY}"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"llama_cpp.server did not start (exit code {proc.poll()})")
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.fixture(scope="module")
def server(qwen_path):
    """The base URL of a llama_cpp.server for this module's tests."""
    port = free_port()
    proc = start_llama_server(qwen_path, port)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc)


@pytest.fixture
def own_server(qwen_path):
    """A server of the test's own, which the test kills: (process, base URL)."""
    port = free_port()
    proc = start_llama_server(qwen_path, port)
    try:
        yield proc, f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc)


def remote(url: str, model: str = ALIAS) -> list[str]:
    return ["--backend", "openai", "--base-url", url, "-m", model, "--api-key", KEY]


def test_run_json_gives_text_and_timings(server):
    out = run_kvchat("run", *remote(server), "--temperature", "0", "-n", "16", "--json",
                     "What is the capital of France? Answer in one word.")
    assert out.returncode == 0, out.stderr.decode()
    result = json.loads(out.stdout)
    assert "Paris" in result["text"]
    assert result["backend"] == "openai" and result["device"] == "remote" and result["model"] == ALIAS
    assert result["finish_reason"] in ("stop", "length") and result["tokens"] == []   # the server gives no ids
    t = result["timings"]
    assert t["predicted_n"] >= 1 and t["ttft_ms"] > 0
    # the same greedy request, streamed as text; the key from the environment instead of --api-key
    args = remote(server)[:-2]
    plain = run_kvchat("run", *args, "--temperature", "0", "-n", "16",
                       "What is the capital of France? Answer in one word.", env={"OPENAI_API_KEY": KEY})
    assert plain.returncode == 0, plain.stderr.decode()
    assert plain.stdout.decode().rstrip("\n") == result["text"]
    assert "ttft" in plain.stderr.decode() and "prompt n/a" in plain.stderr.decode()


def test_plain_completion_with_no_chat(server):
    out = run_kvchat("run", *remote(server), "--no-chat", "--temperature", "0", "-n", "12", "--json",
                     "def fibonacci(n):")
    assert out.returncode == 0, out.stderr.decode()
    result = json.loads(out.stdout)
    assert result["text"].strip() and result["finish_reason"] in ("stop", "length")


def test_batch_writes_one_answer_per_line(server, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": 1, "prompt": "Say the word one."}\n'
                   '{"id": "two", "messages": [{"role": "user", "content": "Say the word two."}]}\n'
                   '{"id": 3, "prompt": "What is 1 + 2? Answer with a number.", "max_tokens": 6}\n')
    out = run_kvchat("batch", str(src), "-o", str(dst), *remote(server), "--temperature", "0", "-n", "12",
                     "--parallel", "3")
    assert out.returncode == 0, out.stderr.decode()
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert sorted(map(str, (r["id"] for r in records))) == ["1", "3", "two"]
    for r in records:
        assert "error" not in r, r
        assert r["text"].strip() and r["finish_reason"] in ("stop", "length") and r["timings"]["predicted_n"] >= 1
    by_id = {r["id"]: r for r in records}
    assert "3" in by_id[3]["text"] and by_id[3]["timings"]["predicted_n"] <= 6
    # run again: every id is answered, nothing is sent
    again = run_kvchat("batch", str(src), "-o", str(dst), *remote(server))
    assert again.returncode == 0 and len(dst.read_text().splitlines()) == 3


def one_error_line(out) -> str:
    lines = out.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvchat: error: ") and "Traceback" not in out.stderr.decode()
    return lines[0]


def test_a_closed_port_is_one_line(server):
    port = free_port()     # nothing listens there
    out = run_kvchat("run", *remote(f"http://127.0.0.1:{port}/v1"), "hi")
    assert out.returncode == 2
    line = one_error_line(out)
    assert f"127.0.0.1:{port}" in line and "cannot reach" in line


def test_server_refusals_are_one_line(server):
    wrong_key = run_kvchat("run", "--backend", "openai", "--base-url", server, "-m", ALIAS, "--api-key", "nope", "hi")
    assert wrong_key.returncode == 2
    line = one_error_line(wrong_key)
    assert "401" in line and server in line
    # a prompt over the server's 2048-token context: it starts the stream and ends it unfinished
    too_long = run_kvchat("run", *remote(server), "-n", "4", "-", input=("hello world " * 1500).encode())
    assert too_long.returncode == 2
    line = one_error_line(too_long)
    assert "/chat/completions" in line and "without finishing" in line


def test_flags_that_need_the_other_one(server):
    out = run_kvchat("run", "--base-url", server, "hi")
    assert out.returncode == 2 and "--base-url goes with --backend openai" in one_error_line(out)
    out = run_kvchat("run", "--backend", "openai", "hi")
    assert out.returncode == 2 and "needs --base-url" in one_error_line(out)
    out = run_kvchat("run", *remote(server), "--speculative", "lookup", "hi")
    assert out.returncode == 2 and "local engines" in one_error_line(out)
    out = run_kvchat("batch", "-", "-o", "/dev/null", "--base-url", server, input=b"")
    assert out.returncode == 2 and "--base-url goes with --backend openai" in one_error_line(out)


def test_run_keeps_what_arrived_when_the_server_dies(own_server):
    proc, url = own_server
    exe = os.path.join(os.path.dirname(sys.executable), "kvchat")
    bans = [a for eos in QWEN_EOS for a in ("--logit-bias", f"{eos}=-inf")]
    run = subprocess.Popen([exe, "run", *remote(url), "-n", "1500", *bans, "Write a long story about a dragon."],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        got = b""
        while len(got) < 40:
            chunk = os.read(run.stdout.fileno(), 4096)
            assert chunk, run.stderr.read().decode()
            got += chunk
        proc.send_signal(signal.SIGKILL)
        rest, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 2
    text = (got + rest).decode()
    assert len(text.strip()) >= 40                              # the partial reply was printed
    errors = [line for line in err.decode().splitlines() if line.startswith("kvchat: error:")]
    assert len(errors) == 1 and url in errors[0] and "Traceback" not in err.decode()
    assert "partial" in err.decode()


# --- the chat ---------------------------------------------------------------------------------
def chat_app(url: str, db, **params):
    from app.tui.app import KvChatApp
    from core.engine import open_engine
    from core.types import SamplingParams
    engine = open_engine(ALIAS, backend="openai", base_url=url, api_key=KEY)
    app = KvChatApp(engine=engine, db_path=db)
    app.params = SamplingParams(**({"temperature": 0.0, "max_tokens": 24, "seed": 1} | params))
    return app, engine


async def send(pilot, text: str) -> None:
    pilot.app.query_one("#input").focus()
    await pilot.press(*[c if c != " " else "space" for c in text])
    await pilot.press("enter")


@pytest.mark.asyncio
async def test_chat_sends_and_shows_the_reply(server, tmp_path):
    from app.tui.widgets.messages import AssistantMessage
    from core.history import History
    from tests.app.conftest import wait_until
    app, engine = chat_app(server, tmp_path / "h.db")
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            assert "openai on remote" in str(app.query_one("#status").render())
            await send(pilot, "What is the capital of France?")
            await wait_until(pilot, lambda: app.reply_widget is not None, 60, "the reply to start")
            await wait_until(pilot, lambda: not app.generating, 120, "the reply to finish")
            await pilot.pause()
            replies = list(app.query(AssistantMessage))
            assert len(replies) == 1 and replies[0].status == "complete"
            assert "Paris" in replies[0].content
            status = str(app.query_one("#status").render())
            assert "TTFT" in status and "prompt n/a" in status and "openai on remote" in status
            app.action_toggle_xray()
            await pilot.pause()
            assert "n/a for this backend" in str(app.query_one("#xray-kv").render())
            stored = History(tmp_path / "h.db").messages(app.conversation_id)
            assert [(m.role, m.status) for m in stored] == [("user", "complete"), ("assistant", "complete")]
            assert stored[1].content == replies[0].content and stored[1].timings["predicted_n"] >= 1
    finally:
        engine.close()


@pytest.mark.asyncio
async def test_chat_escape_stops_a_remote_reply(server, tmp_path):
    from core.history import History
    from tests.app.conftest import wait_until
    no_end = tuple((t, float("-inf")) for t in QWEN_EOS)
    app, engine = chat_app(server, tmp_path / "h.db", max_tokens=1500, logit_bias=no_end, temperature=0.8)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await send(pilot, "Write a long story about a dragon.")
            await wait_until(pilot, lambda: app.reply_widget is not None and len(app.reply_widget.content) > 20,
                             120, "some streamed text")
            await pilot.press("escape")
            await wait_until(pilot, lambda: not app.generating, 60, "the stop")
            await pilot.pause()
            reply = app.reply_widget
            assert reply.status == "stopped" and reply.content
            assert engine.backend.finish_reason == "cancelled" and engine.backend.timings.predicted_n < 1500
            stored = History(tmp_path / "h.db").messages(app.conversation_id)[-1]
            assert stored.status == "stopped" and stored.content == reply.content
    finally:
        engine.close()


@pytest.mark.asyncio
async def test_chat_keeps_a_partial_reply_when_the_server_dies(own_server, tmp_path):
    from core.history import History
    from tests.app.conftest import wait_until
    proc, url = own_server
    no_end = tuple((t, float("-inf")) for t in QWEN_EOS)
    app, engine = chat_app(url, tmp_path / "h.db", max_tokens=1500, logit_bias=no_end)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await send(pilot, "Write a long story about a dragon.")
            await wait_until(pilot, lambda: app.reply_widget is not None and len(app.reply_widget.content) > 40,
                             120, "some streamed text")
            proc.send_signal(signal.SIGKILL)
            await wait_until(pilot, lambda: not app.generating, 60, "the reply to fail")
            await pilot.pause()
            reply = app.reply_widget
            assert reply.status == "error" and len(reply.content) > 40          # kept and marked
            assert any("Generation failed" in str(n.message) and url in str(n.message) for n in app._notifications)
            stored = History(tmp_path / "h.db").messages(app.conversation_id)[-1]
            assert stored.status == "error" and stored.content == reply.content
    finally:
        engine.close()


# --- another kvchat: `kvchat serve` -----------------------------------------------------------
SERVE_MODEL = "qwen2.5-coder-0.5b-instruct"
SERVE_CTX = 1024


@pytest.fixture(scope="module")
def kvchat_server(qwen_path):
    """`kvchat serve` (the native engine) on a free port, with a key: its base URL."""
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "kvchat")
    proc = subprocess.Popen([exe, "serve", "-m", SERVE_MODEL, "--port", str(port), "--ctx", str(SERVE_CTX),
                             "--api-key", KEY, "--threads", "2", "--kv-disk", "off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvchat serve did not start (exit code {proc.poll()})")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc)


def test_run_against_kvchat_serve_reads_its_timings(kvchat_server):
    out = run_kvchat("run", *remote(kvchat_server, SERVE_MODEL), "--temperature", "0", "-n", "16", "--json",
                     "What is the capital of France? Answer in one word.")
    assert out.returncode == 0, out.stderr.decode()
    result = json.loads(out.stdout)
    assert "Paris" in result["text"] and result["finish_reason"] in ("stop", "length")
    t = result["timings"]
    assert t["prompt_n"] > 10 and t["prompt_ms"] > 0 and t["predicted_n"] >= 1   # the server's own timings
    plain = run_kvchat("run", *remote(kvchat_server, SERVE_MODEL), "--temperature", "0", "-n", "16",
                       "What is the capital of France? Answer in one word.")
    assert plain.returncode == 0 and plain.stdout.decode().rstrip("\n") == result["text"]
    # the same prompt again: the server's prefix cache shows in its timings (computed + cached = the prompt)
    m = re.search(r"prompt (\d+) tok, [\d.]+ tok/s \(cached (\d+)\)", plain.stderr.decode())
    assert m and int(m[1]) + int(m[2]) == t["prompt_n"] + t["cache_n"] and int(m[2]) > 0, plain.stderr.decode()
    # its refusal of a prompt over its context is one line with its words
    too_long = run_kvchat("run", *remote(kvchat_server, SERVE_MODEL), "-n", "4", "-", input=("hello world " * 600).encode())
    assert too_long.returncode == 2
    line = one_error_line(too_long)
    assert "400" in line and f"{SERVE_CTX}" in line and kvchat_server in line


def test_batch_against_kvchat_serve(kvchat_server, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"What is {i} + {i}? Answer with a number."}) + "\n"
                           for i in (1, 2, 3)))
    out = run_kvchat("batch", str(src), "-o", str(dst), *remote(kvchat_server, SERVE_MODEL), "--temperature", "0", "-n", "8",
                     "--parallel", "3")
    assert out.returncode == 0, out.stderr.decode()
    records = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert sorted(records) == [1, 2, 3]
    for i, r in records.items():
        assert "error" not in r and str(2 * i) in r["text"] and r["timings"]["prompt_n"] > 0


@pytest.mark.asyncio
async def test_chat_against_kvchat_serve(kvchat_server, tmp_path):
    from app.tui.app import KvChatApp
    from app.tui.widgets.messages import AssistantMessage
    from core.engine import open_engine
    from core.types import SamplingParams
    from tests.app.conftest import wait_until
    engine = open_engine(SERVE_MODEL, backend="openai", base_url=kvchat_server, api_key=KEY)
    assert engine.n_ctx == SERVE_CTX              # read from its /v1/models
    app = KvChatApp(engine=engine, db_path=tmp_path / "h.db")
    app.params = SamplingParams(temperature=0.0, max_tokens=24, seed=1)
    try:
        async with app.run_test(size=(120, 30)) as pilot:
            await send(pilot, "What is the capital of France?")
            await wait_until(pilot, lambda: app.reply_widget is not None, 60, "the reply to start")
            await wait_until(pilot, lambda: not app.generating, 120, "the reply to finish")
            await pilot.pause()
            replies = list(app.query(AssistantMessage))
            assert len(replies) == 1 and replies[0].status == "complete" and "Paris" in replies[0].content
            status = str(app.query_one("#status").render())
            assert "TTFT" in status and f"/{SERVE_CTX}" in status and "prompt n/a" not in status
    finally:
        engine.close()


def test_json_schema_and_grammar_go_to_the_server(kvchat_server, server):
    """--json-schema becomes OpenAI's response_format (kvchat serve constrains its decoding with
    it); --grammar llama-server's `grammar` field (llama-cpp-python's server reads it too)."""
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    out = run_kvchat("run", *remote(kvchat_server, SERVE_MODEL), "--temperature", "0", "-n", "40", "--json-schema", schema,
                     "What is the capital of France? Reply in JSON.")
    assert out.returncode == 0, out.stderr.decode()
    assert isinstance(json.loads(out.stdout)["city"], str)
    out = run_kvchat("run", *remote(server), "--temperature", "0", "-n", "10", "--grammar", 'root ::= "yes" | "no"',
                     "--json", "Is Paris in France?")
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout)["text"] in ("yes", "no")
