"""Attached files (core.attachments): which files are read and which refused, how they go into the
message (before the question), and the refusal of what does not fit, on a real engine's tokens."""
from __future__ import annotations

import pytest

from core.attachments import (MAX_BYTES, Attachment, check_attachment_fits, check_message_fits, compose_message,
                              count_tokens, read_attachment)
from core.chat_session import fit_prompt
from models.errors import BadInputError

MODEL = "gemma-3-270m"
N_CTX = 256


@pytest.fixture(scope="module")
def engine(gemma_path):
    from core.engine import Engine
    eng = Engine(MODEL, backend="llama.cpp", n_ctx=N_CTX, threads=2)
    yield eng
    eng.close()


# --- reading ---------------------------------------------------------------------------------
def test_utf8_text_is_read_as_it_is(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("Привет, мир\nline two ✓\n", encoding="utf-8")
    a = read_attachment(str(path))
    assert a.text == "Привет, мир\nline two ✓\n" and a.name == "notes.md"


def test_a_byte_order_mark_is_not_text(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfhello")
    assert read_attachment(path).text == "hello"


@pytest.mark.parametrize("content, message", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is a binary file"),
    (b"plain text, then a NUL\x00", "is a binary file"),
    (b"caf\xe9 latin-1", "is not valid UTF-8 (byte 3: b'\\xe9')"),
    (b"cut in half \xd0", "is not valid UTF-8 (byte 12"),
])
def test_binary_and_invalid_utf8_are_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "data.bin"
    path.write_bytes(content)
    with pytest.raises(BadInputError) as e:
        read_attachment(path)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_missing_file_directory_and_oversize_are_refused(tmp_path):
    with pytest.raises(BadInputError, match="no such file: .*nope.txt"):
        read_attachment(tmp_path / "nope.txt")
    with pytest.raises(BadInputError, match="is a directory"):
        read_attachment(tmp_path)
    big = tmp_path / "big.log"
    with open(big, "wb") as f:
        f.truncate(MAX_BYTES + (1 << 20))   # sparse: the size is refused before anything is read
    with pytest.raises(BadInputError, match=r"big.log is 5.0 MiB; kvchat attaches text files up to 4 MiB"):
        read_attachment(big)


# --- the message -----------------------------------------------------------------------------
def test_files_go_before_the_question_each_under_its_name(tmp_path):
    a = Attachment(tmp_path / "a.py", "def f():\n    return 1\n")
    b = Attachment(tmp_path / "notes.txt", "no newline at the end")
    message = compose_message("What does f return?", [a, b])
    assert message == ("File: a.py\n```\ndef f():\n    return 1\n```\n\n"
                       "File: notes.txt\n```\nno newline at the end\n```\n\n"
                       "What does f return?")
    # the same file gives the same leading text whatever is asked (the prefix caches' condition)
    other = compose_message("Is f pure?", [a, b])
    assert other.startswith(message[:-len("What does f return?")])
    assert compose_message("  ", [a]) == a.block()


def test_a_fence_inside_the_file_cannot_close_its_block(tmp_path):
    readme = Attachment(tmp_path / "README.md", "Run:\n```bash\nmake\n```\n")
    block = readme.block()
    assert block.startswith("File: README.md\n````\n") and block.endswith("```\n````")


# --- fitting the context ---------------------------------------------------------------------
def test_count_tokens_is_the_block_tokenized_alone(engine, tmp_path):
    a = Attachment(tmp_path / "fact.txt", "The Danube flows through ten countries.\n")
    n = count_tokens(engine, a)
    assert n == len(engine.tokenizer.encode(a.block())) and 10 < n < 40


def test_a_message_that_fits_is_not_refused_and_fits_whole(engine, tmp_path):
    a = Attachment(tmp_path / "fact.txt", "The Danube flows through ten countries.\n")
    messages = [{"role": "user", "content": compose_message("How many countries?", [a])}]
    check_message_fits(engine, messages, [a], chat=False, reserve=16)
    ids, truncated = fit_prompt(engine, messages, chat=False, reserve=16)
    assert not truncated and engine.tokenizer.decode(ids).endswith("How many countries?")


def test_a_file_that_does_not_fit_is_refused_with_its_tokens_and_the_context(engine, tmp_path):
    big = Attachment(tmp_path / "big.txt", "alpha beta gamma delta\n" * 60)
    n_file = count_tokens(engine, big)
    assert n_file > N_CTX
    with pytest.raises(BadInputError) as e:
        check_attachment_fits(big, n_file, engine.n_ctx, reserve=32)
    assert str(e.value) == (f"big.txt is {n_file} tokens but the context holds {N_CTX} (with 32 kept free "
                            "for the reply); attach a smaller file or raise --ctx")
    small = Attachment(tmp_path / "small.txt", "alpha\n")
    check_attachment_fits(small, count_tokens(engine, small), engine.n_ctx, reserve=32)   # no error

    system = {"role": "system", "content": "Answer briefly."}
    messages = [system, {"role": "user", "content": compose_message("Summarize.", [small, big])}]
    n_message = len(engine.prompt_ids(messages, chat=False))
    with pytest.raises(BadInputError) as e:
        check_message_fits(engine, messages, [small, big], chat=False, reserve=32)
    assert str(e.value) == (f"the message with its attachments is {n_message} tokens (small.txt: "
                            f"{count_tokens(engine, small)}, big.txt: {n_file}) but the context holds {N_CTX} "
                            "(with 32 kept free for the reply); attach less or raise --ctx")


def test_only_what_fit_prompt_keeps_counts(engine, tmp_path):
    """Earlier turns are dropped to make room (fit_prompt), so they never make a message too big."""
    a = Attachment(tmp_path / "fact.txt", "The Danube flows through ten countries.\n")
    old = [{"role": "user", "content": "The river flows. " * 80}, {"role": "assistant", "content": "Yes."}]
    messages = old + [{"role": "user", "content": compose_message("How many countries?", [a])}]
    check_message_fits(engine, messages, [a], chat=False, reserve=16)
    ids, truncated = fit_prompt(engine, messages, chat=False, reserve=16)
    assert truncated and len(ids) < N_CTX - 16


def test_count_tokens_in_the_engine_process(gemma_path, engine, tmp_path):
    """The TUI's engine runs in a child process: it counts through the request protocol."""
    from core.engine_process import EngineProcess
    a = Attachment(tmp_path / "fact.txt", "Ein Fluss, два языка, 三 words.\n")
    remote = EngineProcess(MODEL, backend="llama.cpp", n_ctx=N_CTX, threads=1)
    try:
        assert count_tokens(remote, a) == count_tokens(engine, a) > 0
    finally:
        remote.close()
