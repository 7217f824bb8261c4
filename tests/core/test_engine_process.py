"""The TUI's engine in a child process (core.engine_process): the same tokens, timings and errors as
the Engine in-process, cancellation mid-generation, and no child left behind when the app goes."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core.types import SamplingParams
from core.engine import Engine
from core.engine_process import EngineProcess
from models.errors import BadInputError

MODEL = "gemma-3-270m"
N_CTX = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.real_model   # drives kvchat in subprocesses


@pytest.fixture(scope="module")
def remote(gemma_path):
    eng = EngineProcess(MODEL, backend="native", n_ctx=N_CTX, threads=2)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def local(gemma_path):
    eng = Engine(MODEL, backend="native", n_ctx=N_CTX, threads=2)
    yield eng
    eng.close()


def test_runs_in_another_process(remote):
    assert remote.pid != os.getpid() and remote._process.poll() is None
    assert (remote.model_name, remote.backend_name, remote.n_ctx, remote.device) == (MODEL, "native", N_CTX, "cpu")
    caps = remote.backend.capabilities
    assert caps.speculative and caps.decode_threads and caps.batch and caps.engine == "native"


def test_same_tokens_timings_and_reuse_as_in_process(remote, local):
    turns = ["The capital of France is", "The capital of France is Paris. The capital of Spain is"]
    for i, text in enumerate(turns):
        ids_remote, ids_local = remote.prompt_ids(text, chat=False), local.prompt_ids(text, chat=False)
        assert ids_remote == ids_local
        got = [(e.id, e.text) for e in remote.generate(ids_remote, GREEDY)]
        want = [(e.id, e.text) for e in local.generate(ids_local, GREEDY)]
        assert got == want and got
        t = remote.backend.timings
        assert t.predicted_n == len(got) and t.prompt_n + t.cache_n == len(ids_remote)
        assert remote.backend.finish_reason == local.backend.finish_reason
        assert remote.backend.stats.phase == "done"
        if i == 1:   # the second prompt extends the first: its KV blocks are reused in the child
            assert t.cache_n > 0 and t.cache_n == local.backend.timings.cache_n
    assert "used" in remote.backend.kv_block_map()


def test_cancel_reaches_the_child_mid_generation(remote):
    cancel = threading.Event()
    ids = remote.prompt_ids("Once upon a time", chat=False)
    events = []
    for e in remote.generate(ids, SamplingParams(temperature=0.8, seed=3, max_tokens=400), cancel):
        events.append(e)
        if len(events) == 3:
            cancel.set()
    assert remote.backend.finish_reason == "cancelled"
    assert 3 <= len(events) < 400


def test_errors_cross_the_process_and_the_child_keeps_serving(remote, local):
    too_long = list(range(10, 10 + N_CTX + 5))
    with pytest.raises(BadInputError) as remote_error:
        list(remote.generate(too_long, GREEDY))
    with pytest.raises(BadInputError) as local_error:
        list(local.generate(too_long, GREEDY))
    assert str(remote_error.value) == str(local_error.value)
    ids = remote.prompt_ids("One, two,", chat=False)
    assert [e.id for e in remote.generate(ids, GREEDY)] == [e.id for e in local.generate(ids, GREEDY)]


def test_a_generation_left_early_is_drained(remote, local):
    ids = remote.prompt_ids("Red, green,", chat=False)
    gen = remote.generate(ids, SamplingParams(temperature=0.0, max_tokens=200))
    first = [next(gen) for _ in range(2)]
    gen.close()                         # the caller stops iterating: the child is cancelled and drained
    assert len(first) == 2 and remote.backend.finish_reason == "cancelled"
    assert remote.prompt_ids("Red, green,", chat=False) == ids    # the pipe holds no stale messages
    assert [e.id for e in remote.generate(ids, GREEDY)] == [e.id for e in local.generate(ids, GREEDY)]


def test_bad_model_is_the_same_one_line_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + os.urandom(64))
    with pytest.raises(BadInputError) as remote_error:
        EngineProcess(str(bad), backend="native", n_ctx=N_CTX)
    with pytest.raises(BadInputError) as local_error:
        Engine(str(bad), backend="native", n_ctx=N_CTX)
    assert str(remote_error.value) == str(local_error.value) and "\n" not in str(remote_error.value)


CHILD = r"""
import os, sys
from core.engine_process import EngineProcess
e = EngineProcess("gemma-3-270m", backend="native", n_ctx=512)
print(e.pid, flush=True)
sys.stdin.readline()
"""


def test_the_engine_process_ends_when_the_app_is_killed(gemma_path):
    app = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    engine_pid = int(app.stdout.readline())
    assert _alive(engine_pid)
    app.kill()                          # kill -9: no atexit, no close()
    app.wait(10)
    deadline = time.monotonic() + 20
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine_pid), "the engine process outlived the app"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_relative_model_path_and_the_llamacpp_backend(gemma_path, monkeypatch, local):
    """The child works in the caller's folder (a relative -m path), and runs llama.cpp just as well."""
    monkeypatch.chdir(gemma_path.parent)
    eng = EngineProcess(gemma_path.name, backend="llama.cpp", n_ctx=N_CTX, threads=2)
    try:
        assert eng.backend_name == "llama.cpp" and not eng.backend.capabilities.decode_threads
        with pytest.raises(NotImplementedError):
            eng.backend.set_decode_threads(1)
        ids = eng.prompt_ids("The capital of France is", chat=False)
        got = [e.id for e in eng.generate(ids, GREEDY)]
        assert len(got) == eng.backend.timings.predicted_n > 0
    finally:
        eng.close()
