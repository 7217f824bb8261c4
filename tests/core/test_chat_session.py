"""The chat's logic without the TUI: send, reply, regenerate, edit and trimming on a real engine, as
the history records them."""
from __future__ import annotations

import threading

import pytest

from core.chat_session import ChatSession, fit_prompt
from core.engine import Engine
from core.history import History
from core.types import SamplingParams


@pytest.fixture(scope="module")
def engine(gemma_path):
    eng = Engine("gemma-3-270m", backend="llama.cpp", n_ctx=256, threads=2)
    yield eng
    eng.close()


@pytest.fixture
def session(tmp_path):
    s = ChatSession(History(tmp_path / "h.sqlite3"))
    s.params = SamplingParams(temperature=0, max_tokens=8)
    yield s
    s.history.close()


def _reply(session, engine) -> tuple[str, str]:
    reply = session.begin_reply(engine)
    texts: list[str] = []
    end = session.stream_reply(engine, reply, threading.Event(), None, texts.append)
    return "".join(texts), end.status


def test_send_reply_regenerate_edit(session, engine):
    first_id, dropped = session.send("The capital of France is", engine.model_name)
    assert dropped is None and session.conversation_id is not None
    text, status = _reply(session, engine)
    assert status == "complete" and text
    msgs = session.messages()
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[1].content == text

    assert session.drop_last_reply() == msgs[1].id                 # regenerate: the reply goes, greedy gives it again
    assert _reply(session, engine)[0] == text
    assert [m.role for m in session.messages()] == ["user", "assistant"]

    assert session.start_edit() == "The capital of France is"      # edit: the message and all after it are replaced
    new_id, dropped = session.send("The capital of Spain is", engine.model_name)
    assert dropped == first_id
    assert [(m.id, m.role, m.content) for m in session.messages()] == [(new_id, "user", "The capital of Spain is")]
    assert session.params.settings() == session.history.get_conversation(session.conversation_id).settings


def test_trimming_drops_whole_turns_and_keeps_the_system_prompt(engine):
    """The one policy (the chat and `kvchat run` alike): oldest turns first, whole."""
    long = "word " * 60
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(4):
        msgs += [{"role": "user", "content": f"{i} {long}"}, {"role": "assistant", "content": f"reply {i} {long}"}]
    msgs.append({"role": "user", "content": "last question"})
    ids, truncated = fit_prompt(engine, msgs, chat=False, reserve=32)
    assert truncated and len(ids) < engine.n_ctx
    kept = engine.tokenizer.decode(ids)
    assert kept.startswith(engine.tokenizer.decode(engine.prompt_ids(msgs[:1], chat=False)))   # system stays
    assert "last question" in kept and "0 word" not in kept and "reply 0" not in kept  # turn 0 gone, whole
    for i in range(1, 4):   # a turn is kept or dropped with its reply
        assert (f"{i} word" in kept) == (f"reply {i}" in kept)


def test_a_failing_engine_ends_the_reply_as_an_error_and_keeps_its_text(session, engine):
    session.send("Count: one, two,", engine.model_name)
    reply = session.begin_reply(engine)

    class Broken:
        backend = engine.backend

        def generate(self, *args):
            yield from list(engine.generate(*args))[:2]
            raise RuntimeError("the engine process stopped")

    got: list[str] = []
    end = session.stream_reply(Broken(), reply, threading.Event(), None, got.append)
    last = session.messages()[-1]
    assert (end.status, end.summary) == ("error", "the engine process stopped")
    assert last.status == "error" and last.content == "".join(got)


def test_a_chat_started_with_a_schema_replies_in_it(session, engine):
    """`kvchat chat --json-schema`: every reply follows it, also after a stored conversation's
    settings (which never hold a schema) are opened."""
    import json
    session.output_format = {"json_schema": json.dumps({"enum": ["yes", "no"]})}
    session.params = SamplingParams(temperature=0, max_tokens=8)
    session.send("Is the sea salty?", engine.model_name)
    text, status = _reply(session, engine)
    assert status == "complete" and json.loads(text) in ("yes", "no")
    session.open(session.conversation_id)
    assert session.begin_reply(engine).params.json_schema == session.output_format["json_schema"]


def test_decode_threads_tries_both_then_keeps_the_faster():
    from core.chat_session import DecodeThreads
    from models.errors import BadInputError
    d = DecodeThreads(4)
    assert d.choices == [3, 4] and d.next() == 3
    d.record(3, DecodeThreads.MIN_TOKENS - 1, 99.0)        # too short a reply to count
    assert d.next() == 3
    d.record(3, 40, 30.0)
    assert d.next() == 4
    d.record(4, 40, 45.0)
    assert d.next() == 4
    d.record(3, 40, 50.0)                                   # each count's best reply
    assert d.next() == 3 and d.rates == {3: 50.0, 4: 45.0}
    one = DecodeThreads(1)
    assert one.choices == [1] and one.next() == 1
    one.record(1, 40, 10.0)
    assert one.next() == 1
    forced = DecodeThreads(4, "2")
    forced.record(2, 40, 1.0)
    assert forced.next() == 2
    assert DecodeThreads(4, "").next() == 3 and DecodeThreads(4, " 2 ").next() == 2   # empty: unset
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(BadInputError, match="KVCHAT_DECODE_THREADS"):
            DecodeThreads(4, bad)
