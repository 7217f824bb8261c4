"""The TUI driven by Textual's Pilot against the real engine (gemma-3-270m on llama.cpp, a base model:
plain completion) and a real SQLite history."""
from __future__ import annotations

import pytest

from app.tui.app import KvChatApp, TokenArrived
from app.tui.screens.settings import SettingsScreen
from app.tui.widgets.messages import AssistantMessage, UserMessage
from core.types import SamplingParams
from core.history import History
from tests.app.conftest import FIXED_REPLY, wait_until

pytestmark = pytest.mark.asyncio

SIZE = (80, 24)


def make_app(engine, db, **params) -> KvChatApp:
    app = KvChatApp(engine=engine, db_path=db)
    app.params = SamplingParams(**({"temperature": 0.0, "max_tokens": 12, "seed": 1} | params))
    return app


async def type_and_send(pilot, text: str) -> None:
    app = pilot.app
    app.query_one("#input").focus()
    await pilot.press(*[c if c != " " else "space" for c in text])
    await pilot.press("enter")


async def test_send_streams_and_completes(engine, tmp_path):
    db = tmp_path / "h.db"
    tokens = []
    app = make_app(engine, db, max_tokens=24)
    async with app.run_test(size=SIZE, message_hook=lambda m: tokens.append(m) if isinstance(m, TokenArrived) else None) as pilot:
        await type_and_send(pilot, "The capital of France is")
        await wait_until(pilot, lambda: app.generating or app.reply_widget is not None, 120, "generation to start")
        await wait_until(pilot, lambda: not app.generating, 120, "the reply to finish")
        await pilot.pause()
        replies = list(app.query(AssistantMessage))
        assert len(replies) == 1 and replies[0].status == "complete"
        assert replies[0].content.strip()
        assert len(tokens) >= 1
        assert "".join(t.text for t in tokens) == replies[0].content      # streamed text == final text
        assert app.query_one("#input").text == ""                         # the input was cleared
        status = str(app.query_one("#status").render())
        assert "TTFT" in status and "eval" in status and "/512" in status
        stored = History(db).messages(app.conversation_id)
        assert [(m.role, m.status) for m in stored] == [("user", "complete"), ("assistant", "complete")]
        assert stored[0].content == "The capital of France is"
        assert stored[1].content == replies[0].content
        assert stored[1].timings["predicted_n"] >= 1


async def test_escape_stops_mid_stream(engine, tmp_path):
    db = tmp_path / "h.db"
    no_end = tuple((t, float("-inf")) for t in engine.tokenizer.eog_ids)   # it cannot end before the key
    app = make_app(engine, db, max_tokens=400, temperature=0.8, logit_bias=no_end)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "Once upon a time")
        await wait_until(pilot, lambda: app.reply_widget is not None and len(app.reply_widget.content) > 10,
                         120, "some streamed text")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.generating, 90, "the stop")
        reply = app.reply_widget
        assert reply.status == "stopped" and "stopped" in reply.border_subtitle
        assert engine.backend.finish_reason == "cancelled"
        assert engine.backend.timings.predicted_n < 400
        stored = History(db).messages(app.conversation_id)[-1]
        assert stored.status == "stopped" and stored.content == reply.content and stored.content


async def test_regenerate_replaces_last_reply(engine, tmp_path):
    db = tmp_path / "h.db"
    app = make_app(engine, db, temperature=1.0, seed=None, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "My favourite colour is")
        await wait_until(pilot, lambda: app.reply_widget is not None and not app.generating, 120, "first reply")
        first_id = app.reply_widget.message_id
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.reply_widget.message_id != first_id and not app.generating, 60,
                         "regenerated reply")
        await pilot.pause()
        replies = list(app.query(AssistantMessage))
        assert len(replies) == 1 and replies[0].message_id != first_id and replies[0].status == "complete"
        stored = History(db).messages(app.conversation_id)
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].id != first_id


async def test_edit_and_resend_last_message(engine, fixed_db):
    app = make_app(engine, fixed_db, max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+e")
        box = app.query_one("#input")
        assert box.text == "Write a Python function that adds two numbers."
        box.text = "Write a Python function that multiplies"
        box.focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.reply_widget is not None and not app.generating, 120, "the new reply")
        stored = History(fixed_db).messages(app.conversation_id)
        assert [m.role for m in stored] == ["user", "assistant"]
        assert stored[0].content == "Write a Python function that multiplies"
        assert FIXED_REPLY not in [m.content for m in stored]
        assert [u.content for u in app.query(UserMessage)] == ["Write a Python function that multiplies"]


async def test_history_survives_restart(engine, tmp_path):
    db = tmp_path / "h.db"
    app = make_app(engine, db, max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "Roses are red")
        await wait_until(pilot, lambda: app.reply_widget is not None and not app.generating, 120, "reply")
        reply_text = app.reply_widget.content
        conversation_id = app.conversation_id
    again = make_app(engine, db)
    async with again.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert again.conversation_id == conversation_id
        assert [u.content for u in again.query(UserMessage)] == ["Roses are red"]
        assert [a.content for a in again.query(AssistantMessage)] == [reply_text]
        titles = [str(item.conversation.title) for item in again.query("ConversationItem")]
        assert titles == ["Roses are red"]


async def test_long_chat_mounts_only_recent_messages(engine, tmp_path, monkeypatch):
    """A long chat mounts its last SHOWN_MESSAGES messages behind an "earlier messages" line (every
    layout pass of a streaming reply walks the mounted widgets); f6 shows them all; sending trims
    the view again once it is well over the limit. Nothing leaves the history."""
    import app.tui.widgets.chat_view as tui
    from app.tui.widgets.messages import EarlierMessages, MessageBox
    db = tmp_path / "h.db"
    h = History(db)
    conv = h.create_conversation("long", model=engine.model_name)
    for i in range(20):
        h.add_message(conv, "user", f"question {i}")
        h.add_message(conv, "assistant", f"answer {i}", model=engine.model_name)
    h.close()
    app = make_app(engine, db, max_tokens=2)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        boxes = list(app.query(MessageBox))
        assert len(boxes) == tui.SHOWN_MESSAGES == 30
        assert boxes[0].content == "question 5" and boxes[-1].content == "answer 19"
        assert app.query_one(EarlierMessages).n_hidden == 10
        await pilot.press("f6")
        await pilot.pause()
        assert len(app.query(MessageBox)) == 40 and not app.query(EarlierMessages)
        monkeypatch.setattr(tui, "SHOWN_MESSAGES", 4)
        await type_and_send(pilot, "one more")
        await wait_until(pilot, lambda: app.reply_widget is not None and not app.generating, 120, "reply")
        boxes = list(app.query(MessageBox))
        # trimmed when the message was sent (41 mounted > 4 + 10), then the reply joined
        assert [b.content for b in boxes] == ["answer 18", "question 19", "answer 19", "one more",
                                              app.reply_widget.content]
        assert app.query_one(EarlierMessages).n_hidden == 37
        assert len(History(db).messages(conv)) == 42


async def test_corrupt_model_file_is_reported_and_current_model_kept(engine, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 1000)
    app = make_app(engine, tmp_path / "h.db")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.press("f5")
        await pilot.pause()
        app.screen.query_one("#model-path").value = str(bad)
        app.screen.query_one("#model-path").focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: any("Could not load" in n.message for n in app._notifications), 90,
                         "the error notification")
        note = next(n for n in app._notifications if "Could not load" in n.message)
        assert note.severity == "error" and "broken.gguf" in note.message and "keeping gemma-3-270m" in note.message
        assert app.engine is engine and app.loading_model is None
        assert not app.query_one("#model-loading").display


async def test_a_file_the_engine_lacks_runs_on_llamacpp_and_the_app_says_so(engine, tmp_path):
    """--backend auto in the chat: a model with a tensor type kvchat's engine lacks (TQ2_0) loads on
    llama.cpp; a warning says why and the status bar names the engine."""
    import llama_cpp

    from tests.engine.conftest import requantize, write_tiny_model
    iq = requantize(write_tiny_model(tmp_path / "f32.gguf", "llama", "F32"), tmp_path / "tq2.gguf",
                    llama_cpp.LLAMA_FTYPE_MOSTLY_TQ2_0)
    app = make_app(engine, tmp_path / "h.db")
    async with app.run_test(size=(120, 24), notifications=True) as pilot:
        await pilot.press("f5")
        await pilot.pause()
        app.screen.query_one("#model-path").value = str(iq)
        app.screen.query_one("#model-path").focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.engine is not engine and app.engine is not None, 120, "the model to load")
        await pilot.pause()
        note = next(n for n in app._notifications if "TQ2_0" in n.message)
        assert note.severity == "warning" and "using llama.cpp" in note.message
        assert app.engine.backend_name == "llama.cpp"
        assert "llama.cpp on cpu" in str(app.query_one("#status").render())
    # the engine handed in is the caller's: switching models did not close it
    assert len(list(engine.generate(engine.prompt_ids("Hi", chat=False), SamplingParams(max_tokens=2)))) >= 1


async def test_bad_setting_is_refused_in_place(engine, tmp_path):
    db = tmp_path / "h.db"
    app = make_app(engine, db)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#set-temperature").value = "-1"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen
        assert "temperature must be in [0, 10]" in str(screen.query_one("#settings-error").render())
        screen.query_one("#set-temperature").value = "0.5"
        screen.query_one("#set-top_k").value = "many"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen and "top-k" in str(screen.query_one("#settings-error").render())
        screen.query_one("#set-top_k").value = "20"
        screen.query_one("#set-seed").value = "42"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen)
        assert (app.params.temperature, app.params.top_k, app.params.seed) == (0.5, 20, 42)


async def test_copy_keys_rename_and_delete(engine, fixed_db):
    app = make_app(engine, fixed_db)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+l")
        assert app.clipboard == "def add(a, b):\n    return a + b"
        await pilot.press("ctrl+g")
        assert app.clipboard == FIXED_REPLY
        current = app.conversation_id
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("#prompt-value").value = "Sums"
        app.screen.query_one("#prompt-value").focus()
        await pilot.press("enter")
        await pilot.pause()
        assert History(fixed_db).get_conversation(current).title == "Sums"
        await pilot.press("f8")
        await pilot.pause()
        await pilot.press("escape")          # no: nothing deleted
        await pilot.pause()
        assert len(History(fixed_db).list_conversations()) == 2
        await pilot.press("f8")
        await pilot.pause()
        await pilot.press("y")
        await pilot.pause()
        remaining = History(fixed_db).list_conversations()
        assert [c.title for c in remaining] == ["Greetings"] and app.conversation_id == remaining[0].id
        assert [u.content for u in app.query(UserMessage)] == ["Hello"]


async def test_xray_shows_speculative_acceptance(tmp_path):
    """`kvchat chat --speculative lookup` on the native engine: the reply is the plain greedy text
    and the X-ray reports how many drafts were accepted."""
    from core.types import SpeculativeConfig
    from core.engine import Engine
    from tests.app.conftest import MODEL, N_CTX

    native = Engine(MODEL, backend="native", n_ctx=N_CTX, threads=2)
    try:
        prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
        params = SamplingParams(temperature=0.0, max_tokens=24)
        native.backend.reset()
        plain = "".join(e.text for e in native.generate(native.prompt_ids(prompt, chat=False), params))
        native.backend.reset()
        app = KvChatApp(engine=native, db_path=tmp_path / "h.db", speculative=SpeculativeConfig("lookup", 3))
        app.params = params
        async with app.run_test(size=(110, 32)) as pilot:
            await type_and_send(pilot, prompt)
            await wait_until(pilot, lambda: app.reply_widget is not None and not app.generating, 120, "the reply")
            await pilot.press("ctrl+t")
            await pilot.pause()
            spec = str(app.query_one("#xray-spec").render())
            assert spec.startswith("speculative lookup\n") and "drafts accepted" in spec, spec
            accepted, drafted = map(int, spec.splitlines()[1].split(" ")[0].split("/"))
            assert 0 < accepted <= drafted
            assert app.reply_widget.content == plain
            from kernels.cpu.isa import variant      # the X-ray names the CPU kernels' variant
            assert str(app.query_one("#xray-engine").render()) == f"ran on native on cpu\n({variant()})"
    finally:
        native.close()


async def test_the_chat_measures_its_decode_threads(tmp_path):
    """The chat's first reply decodes on every core but one, the second on all, the third on the
    faster of the two (core.chat_session.DecodeThreads); the thread counts reach the engine."""
    import os

    from core.chat_session import DecodeThreads
    from core.engine import Engine
    from tests.app.conftest import MODEL, N_CTX

    native = Engine(MODEL, backend="native", n_ctx=N_CTX)
    calls, set_threads = [], native.backend.set_decode_threads
    native.backend.set_decode_threads = lambda n: (calls.append(n), set_threads(n))
    try:
        app = KvChatApp(engine=native, db_path=tmp_path / "h.db")
        no_end = tuple((t, -100.0) for t in native.tokenizer.eog_ids)          # every reply 20 tokens
        app.params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias=no_end)
        async with app.run_test(size=(110, 32)) as pilot:
            for turn in range(3):
                await type_and_send(pilot, f"Count to twenty, turn {turn}.")
                await wait_until(pilot, lambda: len(calls) == turn + 1 and not app.generating, 120, "the reply")
                await pilot.pause()
        cores = os.cpu_count() or 1
        first, second = max(1, cores - 1), cores
        rates = app.decode_threads.rates
        assert set(rates) == {first, second} and all(r > 0 for r in rates.values())
        assert calls[:2] == [first, second] and calls[2] == max(rates, key=rates.get)
        assert DecodeThreads.MIN_TOKENS <= 20
    finally:
        native.close()


async def test_a_model_the_app_loads_runs_in_its_own_process(tmp_path, gemma_path):
    """`kvchat chat` loads its model into a child process (core.engine_process): the reply, the live
    numbers and the history are as with an in-process engine, and the child ends with the app."""
    import os

    from core.engine import Engine
    from core.engine_process import EngineProcess
    db = tmp_path / "h.db"
    params = SamplingParams(temperature=0.0, max_tokens=12, seed=1)
    app = KvChatApp(model="gemma-3-270m", backend="native", n_ctx=512, db_path=db)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine is not None, 120, "the model to load")
        engine = app.engine
        assert isinstance(engine, EngineProcess) and engine.pid != os.getpid()
        app.params = params
        await type_and_send(pilot, "The capital of France is")
        await wait_until(pilot, lambda: app.reply_widget is not None, 60, "the reply to start")
        await wait_until(pilot, lambda: not app.generating, 120, "the reply to finish")
        await pilot.pause()
        reply = app.reply_widget.content
        status = str(app.query_one("#status").render())
        assert "TTFT" in status and "eval" in status and "/512" in status
    assert engine._process.wait(10) == 0          # closed with the app
    stored = History(db).messages(app.conversation_id)
    assert [(m.role, m.status) for m in stored] == [("user", "complete"), ("assistant", "complete")]
    assert stored[1].content == reply and stored[1].timings["predicted_n"] >= 1
    local = Engine("gemma-3-270m", backend="native", n_ctx=512)
    try:
        ids = local.prompt_ids([{"role": "user", "content": "The capital of France is"}], chat=local.has_chat_template)
        assert reply == "".join(e.text for e in local.generate(ids, params)) and reply
    finally:
        local.close()


async def test_a_killed_engine_process_is_an_error_not_a_crash(tmp_path, gemma_path):
    """The engine's process dies (OOM killer, kill -9): sending says so, and the app, its history and
    a model reload (f5's path) keep working."""
    import os
    import signal

    db = tmp_path / "h.db"
    app = KvChatApp(model="gemma-3-270m", backend="llama.cpp", n_ctx=512, db_path=db)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine is not None, 120, "the model to load")
        dead = app.engine
        os.kill(dead.pid, signal.SIGKILL)
        dead._process.wait(10)
        await type_and_send(pilot, "Hello")
        await pilot.pause()
        assert not app.generating and app.is_running
        assert any("engine process stopped" in str(n.message) for n in app._notifications)
        app.load_model("gemma-3-270m")
        await wait_until(pilot, lambda: app.engine is not dead and app.engine is not None, 120, "the reload")
        app.params = SamplingParams(temperature=0.0, max_tokens=4, seed=1)
        await app.send("Hello again")
        await wait_until(pilot, lambda: app.reply_widget is not None and not app.generating, 120, "a reply")
        assert app.reply_widget.status == "complete" and app.reply_widget.content


async def test_five_turns_reuse_the_history_and_the_status_bar_shows_it(tmp_path):
    """`kvchat chat` on the native engine, five turns: each turn prefills only its new tail, the rest
    of the conversation comes from the KV cache, and the status bar's cache_n grows turn by turn."""
    import re

    from core.engine import Engine
    from tests.app.conftest import MODEL, N_CTX

    native = Engine(MODEL, backend="native", n_ctx=N_CTX, threads=2)
    db = tmp_path / "h.db"
    try:
        native.backend.reset()
        app = make_app(native, db, max_tokens=8)
        shown = []
        async with app.run_test(size=(120, 24)) as pilot:
            for text in ["Tell me about owls", "And about bats", "Which one sleeps longer",
                         "Where do they live", "Thanks"]:
                await type_and_send(pilot, text)
                await wait_until(pilot, lambda: app.generating or app.reply_widget is not None, 60, "the reply to start")
                await wait_until(pilot, lambda: not app.generating, 120, "the reply to finish")
                await pilot.pause()
                status = str(app.query_one("#status").render())
                shown.append(int(re.search(r"cache_n (\d+)", status).group(1)))
        stored = [m.timings for m in History(db).messages(app.conversation_id) if m.role == "assistant"]
        assert len(stored) == 5
        assert shown == [t["cache_n"] for t in stored]
        assert all(b > a for a, b in zip(shown, shown[1:])), shown                          # grows every turn
        # each turn prefills only its new tail (the reply's last token, a blank line, the new message),
        # however long the conversation gets: the TTFT stays flat
        tails = [t["prompt_n"] for t in stored[1:]]
        assert max(tails) < 12 and stored[-1]["cache_n"] > 4 * max(tails), stored
    finally:
        native.close()


async def test_a_reopened_chat_restores_its_kv_blocks_from_disk(tmp_path, monkeypatch):
    """`kvchat chat --kv-disk on`: a turn, then quit; a new app (a new engine process) reopens the
    chat, and the next message's prompt comes from the disk KV cache, as the status bar, the X-ray and
    the stored timings say."""
    import re

    monkeypatch.setenv("KVCHAT_KV_DIR", str(tmp_path / "kv"))
    db = tmp_path / "h.db"
    params = SamplingParams(temperature=0.0, max_tokens=8, seed=1)
    first_message = " ".join(f"Owl {i} lives in the forest by the river and hunts at night." for i in range(8))

    async def turn(app, pilot, text: str) -> None:
        await wait_until(pilot, lambda: app.engine is not None, 120, "the model to load")
        app.params = params
        await type_and_send(pilot, text)
        await wait_until(pilot, lambda: app.reply_widget is not None, 60, "the reply to start")
        await wait_until(pilot, lambda: not app.generating, 120, "the reply to finish")
        await pilot.pause()

    app = KvChatApp(model="gemma-3-270m", backend="native", n_ctx=512, db_path=db, kv_disk={"kv_disk": True})
    async with app.run_test(size=(120, 24)) as pilot:
        await turn(app, pilot, first_message)
        conversation_id = app.conversation_id
    again = KvChatApp(model="gemma-3-270m", backend="native", n_ctx=512, db_path=db, kv_disk={"kv_disk": True})
    async with again.run_test(size=(120, 24)) as pilot:
        await turn(again, pilot, "Which owl hunts by the river?")
        assert again.conversation_id == conversation_id
        status = str(again.query_one("#status").render())
        from_disk = int(re.search(r"from disk (\d+)", status).group(1))
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert f"({from_disk} from disk)" in str(again.query_one("#xray-prefix").render())
    stored = [m.timings for m in History(db).messages(conversation_id) if m.role == "assistant"]
    assert stored[0]["cache_disk_n"] == 0
    assert stored[1]["cache_disk_n"] == from_disk and from_disk >= 96          # the first turn's full blocks
    assert stored[1]["prompt_n"] < 32
