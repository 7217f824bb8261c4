"""`kvchat run -f FILE "question"` driven as a user would (the installed console script, the default
model): the file's text reaches the model before the question, and what cannot be attached is one
line and exit 2."""
import json

import pytest

from core.attachments import compose_message, read_attachment
from tests.conftest import run_kvchat

pytestmark = pytest.mark.real_model   # drives kvchat in subprocesses

GREEDY = ["--backend", "llama.cpp", "--temperature", "0", "--max-tokens", "12"]
QUESTION = "What is Zorblax's favourite fruit? Answer in one word."


@pytest.fixture(scope="module")
def engine(qwen_path):
    """The same model in-process, to count what the command should have sent."""
    from core.engine import Engine
    eng = Engine("qwen2.5-coder-0.5b-instruct", backend="llama.cpp", n_ctx=512, threads=2)
    yield eng
    eng.close()


def test_the_files_text_goes_into_the_message_before_the_question(engine, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("Zorblax lives on Mars.\nZorblax's favourite fruit is the quince.\n", encoding="utf-8")
    other = tmp_path / "other.md"
    other.write_text("# Unrelated\nThe sky is blue.\n", encoding="utf-8")
    out = run_kvchat("run", "-f", str(notes), "--file", str(other), QUESTION, "--json", *GREEDY)
    assert out.returncode == 0, out.stderr.decode()
    result = json.loads(out.stdout)
    # exactly the composed message was the prompt: both files, under their names, then the question
    message = compose_message(QUESTION, [read_attachment(notes), read_attachment(other)])
    assert message.index("File: notes.txt") < message.index("File: other.md") < message.index(QUESTION)
    ids = engine.prompt_ids([{"role": "user", "content": message}], chat=True)
    timings = result["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == len(ids)
    assert "quince" in result["text"].lower()          # the model read the file


@pytest.mark.parametrize("content, message", [
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "is a binary file"),
    (b"caf\xe9 au lait", "is not valid UTF-8 (byte 3"),
    (None, "no such file"),
])
def test_a_file_that_is_not_text_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "input.dat"
    if content is not None:
        path.write_bytes(content)
    out = run_kvchat("run", "-f", str(path), "Summarize it.", *GREEDY)
    err = out.stderr.decode()
    assert out.returncode == 2, err
    assert err.startswith("kvchat: error: ") and message in err and str(path) in err
    assert len(err.strip().splitlines()) == 1 and out.stdout == b""


def test_an_attachment_that_does_not_fit_gives_its_tokens_and_the_context(engine, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("The quick brown fox jumps over the lazy dog.\n" * 20, encoding="utf-8")
    out = run_kvchat("run", "-f", str(big), "Summarize it.", "--ctx", "128", *GREEDY)
    err = out.stderr.decode()
    assert out.returncode == 2, err
    attachment = read_attachment(big)
    n_message = len(engine.prompt_ids([{"role": "user", "content": compose_message("Summarize it.", [attachment])}]))
    n_file = engine.count_tokens(attachment.block())
    assert err.strip() == (f"kvchat: error: the message with its attachments is {n_message} tokens "
                           f"(big.txt: {n_file}) but the context holds 128; attach less or raise --ctx")
    assert "Traceback" not in err and out.stdout == b""
