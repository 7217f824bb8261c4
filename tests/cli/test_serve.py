"""`kvchat serve` driven as a client would: the server in a subprocess, the official openai client
(and raw HTTP for what the client cannot send: bad JSON, an oversized body)."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.conftest import run_kvchat

pytestmark = pytest.mark.real_model   # drives kvchat in subprocesses

KEY = "test-key-123"
MODEL_ARGS = ["--backend", "native", "--ctx", "2048", "--threads", "2"]
QUESTION = "Tell me a fun fact about the Roman Empire"


@pytest.fixture(scope="module")
def server(qwen_path):
    """A running `kvchat serve` on a free port (--port 0: it prints the one it got); killed at the end."""
    exe = Path(sys.executable).parent / "kvchat"
    log = tempfile.NamedTemporaryFile(prefix="kvchat-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(exe), "serve", "-m", str(qwen_path), *MODEL_ARGS, "--port", "0",
                             "--api-key", KEY, "--max-concurrency", "4", "--max-body", "64K"],
                            stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
    try:
        url = None
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            assert proc.poll() is None, Path(log.name).read_text()
            for line in Path(log.name).read_text().splitlines():
                if "kvchat: serving" in line and "http://" in line:
                    url = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
            time.sleep(0.2)
        assert url, Path(log.name).read_text()
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        yield {"url": url, "proc": proc, "log": log.name}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.unlink(log.name)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, timeout=300, max_retries=0)


def health(server) -> dict:
    with urllib.request.urlopen(server["url"] + "/health", timeout=10) as r:
        return json.loads(r.read())


def post(server, path: str, data: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(server["url"] + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_error_object(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"]
    return err


def test_models_lists_the_loaded_model(server, client, qwen_path):
    ids = [m.id for m in client.models.list().data]
    assert ids == [str(qwen_path)]


def test_chat_completion_is_kvchat_runs_greedy_answer(server, client, qwen_path):
    run = run_kvchat("run", QUESTION, "-m", str(qwen_path), *MODEL_ARGS, "--json", "--temperature", "0", "-n", "24")
    assert run.returncode == 0, run.stderr.decode()
    expected = json.loads(run.stdout)
    resp = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=24)
    assert resp.object == "chat.completion" and resp.model == str(qwen_path)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected["text"]
    assert resp.choices[0].finish_reason == expected["finish_reason"] == "length"
    t = expected["timings"]
    assert resp.usage.completion_tokens == t["predicted_n"] == 24
    assert resp.usage.prompt_tokens == t["prompt_n"] + t["cache_n"]
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 24
    timings = resp.model_extra["timings"]    # llama-server's fields
    assert set(timings) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"}
    assert timings["predicted_n"] == 24

    # Streamed, the chunks concatenate to the text of the same request not streamed. (Both reuse the
    # prompt's full KV blocks, which the first request left: greedy text computed over a reused
    # prefix may differ from a cold run's, as in the chat, so it is compared with a warm request.)
    stream = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                            temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    warm = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=24)
    assert text == warm.choices[0].message.content and text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24   # include_usage: the last chunk
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    # the same prompt again: its prefix came from the KV cache
    cache_n = chunks[-1].model_extra["timings"]["cache_n"]
    assert cache_n > 0 and warm.model_extra["timings"]["cache_n"] == cache_n


def test_completions_streaming_and_not_agree(server, client):
    prompt = "def fibonacci(n):"
    resp = client.completions.create(model="any", prompt=prompt, temperature=0, max_tokens=20)
    assert resp.object == "text_completion"
    whole = resp.choices[0].text
    assert whole.strip() and resp.usage.completion_tokens == 20 and resp.choices[0].finish_reason == "length"
    pieces = [c.choices[0].text for c in client.completions.create(model="any", prompt=prompt, temperature=0,
                                                                  max_tokens=20, stream=True) if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == whole


def test_two_concurrent_streams_each_give_their_answer_alone(server, client):
    questions = ["What is the capital of France?", "Write a haiku about rust."]

    def alone(q):
        return client.chat.completions.create(model="any", messages=[{"role": "user", "content": q}],
                                              temperature=0, max_tokens=16).choices[0].message.content
    # each asked alone twice: the second reuses the prompt's full KV blocks, as the concurrent ones do
    alone = [[alone(q) for _ in range(2)][-1] for q in questions]
    texts: list = [None, None]
    errors: list = []

    def ask(i):
        try:
            s = client.chat.completions.create(model="any", messages=[{"role": "user", "content": questions[i]}],
                                               temperature=0, max_tokens=16, stream=True)
            texts[i] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
        except Exception as e:      # (reported by the assert below)
            errors.append(e)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert texts == alone   # batched greedy output is each request's output alone


def test_closing_a_stream_cancels_its_request(server, client):
    before = health(server)["cancelled"]
    stream = client.chat.completions.create(model="any", temperature=0, max_tokens=1500, stream=True,
                                            messages=[{"role": "user", "content": "Write a very long story about a dragon."}])
    got = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got.append(chunk.choices[0].delta.content)
        if len(got) >= 3:
            break
    stream.close()
    assert len(got) == 3
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        h = health(server)
        if h["cancelled"] > before and h["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert h["cancelled"] == before + 1 and h["in_flight"] == 0
    # the server goes on serving
    resp = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hello."}],
                                          temperature=0, max_tokens=8)
    assert resp.choices[0].message.content and server["proc"].poll() is None


def test_a_wrong_or_missing_key_is_refused(server):
    bad = openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, body = post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 4}', key=None)
    assert status == 401 and assert_error_object(body)["type"] == "authentication_error"


def test_bad_requests_get_openai_error_objects(server, client):
    status, body = post(server, "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and assert_error_object(body)["code"] == "invalid_json"

    msgs = [{"role": "user", "content": "hi"}]
    status, body = post(server, "/v1/chat/completions", json.dumps({"messages": msgs, "temperature": "hot"}).encode())
    assert status == 400 and assert_error_object(body)["param"] == "temperature"
    status, body = post(server, "/v1/chat/completions", json.dumps({"messages": msgs, "stream": "yes"}).encode())
    assert status == 400 and assert_error_object(body)["param"] == "stream"
    status, body = post(server, "/v1/completions", json.dumps({"prompt": 42}).encode())
    assert status == 400 and assert_error_object(body)["param"] == "prompt"
    status, body = post(server, "/v1/chat/completions", json.dumps({"messages": msgs, "top_p": 7}).encode())
    assert status == 400 and assert_error_object(body)["param"] == "top_p"

    with pytest.raises(openai.BadRequestError) as e:    # a prompt over the 2048-token context
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "word " * 3000}])
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"

    status, body = post(server, "/v1/completions", json.dumps({"prompt": "x" * 70_000}).encode())
    assert status == 413 and assert_error_object(body)["code"] == "request_too_large"

    with urllib.request.urlopen(server["url"] + "/health", timeout=10) as r:
        assert r.status == 200      # none of that hurt the server
    resp = client.completions.create(model="any", prompt="1, 2, 3,", temperature=0, max_tokens=4)
    assert resp.choices[0].text


def test_response_format_constrains_the_output_to_json(server, client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    resp = client.chat.completions.create(
        model="any", temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Invent a person. Answer with their name and age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    person = json.loads(resp.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
    resp = client.chat.completions.create(
        model="any", temperature=0, max_tokens=80, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat in a few words."}])
    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_schema", "json_schema": {"schema": 5}})
    assert e.value.status_code == 400 and e.value.param == "response_format"
