"""Shared fixtures for the app tests: one real engine (gemma-3-270m on llama.cpp) for the session,
and a history database with fixed contents for the deterministic screens."""
from __future__ import annotations

import time

import pytest

from core.history import History

MODEL = "gemma-3-270m"
N_CTX = 512


@pytest.fixture(scope="session")
def engine(gemma_path):
    from core.engine import Engine
    eng = Engine(MODEL, backend="llama.cpp", n_ctx=N_CTX, threads=2)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path, monkeypatch):
    """Keep exports and any default-path history out of the user's folders."""
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))


FIXED_REPLY = """\
Here is a function that adds two numbers:

```python
def add(a, b):
    return a + b
```

Call it as `add(2, 3)`."""


@pytest.fixture
def fixed_db(tmp_path):
    """A database with two chats; the newer one has a reply with a code block."""
    path = tmp_path / "history.sqlite3"
    h = History(path)
    old = h.create_conversation("Greetings", model=MODEL)
    h.add_message(old, "user", "Hello")
    h.add_message(old, "assistant", "Hi! How can I help?", model=MODEL)
    conv = h.create_conversation("Adding numbers in Python", model=MODEL,
                                 settings={"temperature": 0.0, "max_tokens": 16, "seed": 7})
    h.add_message(conv, "user", "Write a Python function that adds two numbers.")
    h.add_message(conv, "assistant", FIXED_REPLY, model=MODEL)
    h.close()
    time.sleep(0.01)
    return path


async def wait_until(pilot, condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await pilot.pause(0.05)
