"""kill -9 while a reply streams: every completed message survives and the database is intact.

The child is the real app (headless, driven by Pilot) on the real engine, writing through
core.history exactly as an interactive session does."""
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.history import History

CHILD = r"""
import asyncio, sys
from app.tui.app import KvChatApp
from core.types import SamplingParams
from core.engine import Engine

async def main(db):
    engine = Engine("gemma-3-270m", backend="llama.cpp", n_ctx=2048, threads=2)
    app = KvChatApp(engine=engine, db_path=db)
    # the long reply cannot end before the kill, however fast the machine: no end-of-text token
    no_end = tuple((t, float("-inf")) for t in engine.tokenizer.eog_ids)
    async with app.run_test(size=(80, 24)) as pilot:
        for i, (prompt, n) in enumerate([("One, two,", 6), ("Red, green,", 6), ("A long story:", 1500)]):
            app.params = SamplingParams(temperature=0.8, max_tokens=n, seed=i, logit_bias=no_end if n > 100 else ())
            await app.send(prompt)
            print("SENT", prompt, flush=True)
            announced = False
            while app.generating:
                await pilot.pause(0.05)
                if n > 100 and not announced and len(app.reply_widget.content) > 20:
                    print("STREAMING", app.reply_widget.message_id, flush=True)
                    announced = True
            print("DONE", app.reply_widget.message_id, repr(app.reply_widget.content), flush=True)

asyncio.run(main(sys.argv[1]))
"""

pytestmark = pytest.mark.real_model   # drives kvchat in subprocesses


def test_sigkill_during_streaming_loses_no_completed_message(tmp_path):
    db = tmp_path / "history.sqlite3"
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db)], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=os.environ | {"PYTHONPATH": str(root)})
    done, sent, streaming = {}, [], None
    deadline = time.monotonic() + 150
    try:
        for line in child.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "SENT":
                sent.append(rest)
            elif kind == "DONE":
                reply_id, _, text = rest.partition(" ")
                done[int(reply_id)] = eval(text)   # repr() from our own child
            elif kind == "STREAMING":
                streaming = int(rest)
                time.sleep(0.7)                    # past at least one checkpoint, still mid-reply
                break
            assert time.monotonic() < deadline, "the child took too long"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert len(done) == 2 and streaming is not None, (done, streaming)

    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    history = History(db)
    conversations = history.list_conversations()
    assert len(conversations) == 1
    messages = history.messages(conversations[0].id)
    users = [m.content for m in messages if m.role == "user"]
    assert users == sent == ["One, two,", "Red, green,", "A long story:"]
    for reply_id, text in done.items():
        stored = history.get_message(reply_id)
        assert (stored.role, stored.status, stored.content) == ("assistant", "complete", text)
    cut = history.get_message(streaming)
    assert cut.status in ("streaming", "interrupted") and len(cut.content) > 0   # the checkpointed part
