"""Our tokenizers must give llama.cpp's ids exactly, for every registry model."""
import llama_cpp
import pytest

from core.tokenizer import Tokenizer
from models.gguf_file import open_model

CORPUS = [
    "Hello world! How are you today?",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, they're here, I'd've.",
    "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "我爱自然语言处理。你好，世界！今天天气很好。",
    "日本語のテキストと한국어 텍스트도 있습니다.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "emoji: 😀🎉👍🏽 families 👨‍👩‍👧‍👦 flags 🇺🇦🇯🇵 ✨",
    "   leading spaces,    inner runs     and trailing   ",
    "line\n\nbreaks\n\n\n\nand\r\nwindows\r\n\ttabs\t\there",
    "numbers 1234567890 3.14159 -2.5e-10 0x1F 1,000,000",
    "mixed ÀÉÎÕÜ ñ ß ø æ œ ﬁ ligature and \u00a0non-breaking\u2003spaces",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nWrite a poem<end_of_turn>\n<start_of_turn>model\n",
    "<|endoftext|> <eos> <unk> <pad> <|fim_prefix|>code<|fim_suffix|><|fim_middle|>",
    "",
    " ",
    "\n",
    "a",
]
MODELS = ["qwen_path", "gemma_path", "qwen15_path"]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    path = request.getfixturevalue(request.param)
    ours = Tokenizer.from_gguf(open_model(path))
    theirs = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    yield ours, theirs
    theirs.close()


@pytest.mark.parametrize("special", [False, True], ids=["text", "special"])
def test_matches_llama_cpp_on_corpus(pair, special):
    ours, theirs = pair
    for text in CORPUS:
        expected = theirs.tokenize(text.encode(), add_bos=False, special=special)
        assert ours.encode(text, special=special) == expected, repr(text)


def test_bos_follows_gguf_flag(pair):
    ours, theirs = pair
    text = "Hello"
    assert ours.encode(text, add_bos=ours.add_bos) == theirs.tokenize(text.encode(), add_bos=True, special=False)


def test_decode_round_trips_text(pair):
    ours, _ = pair
    for text in CORPUS:
        if "<" in text:   # control tokens render as nothing when decoding without special
            continue
        assert ours.decode(ours.encode(text)) == text


def test_stream_decoder_never_emits_half_a_character(pair):
    ours, _ = pair
    text = "emoji 😀🎉👍🏽 и кириллица 中文 👨‍👩‍👧‍👦 𠀋𝔘𓀀"
    ids = ours.encode(text)
    decoder = ours.stream_decoder()
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # some characters really are split across tokens, so the test exercises the hold-back
    def is_partial(raw: bytes) -> bool:
        try:
            raw.decode("utf-8")
            return False
        except UnicodeDecodeError:
            return True
    assert sum(is_partial(ours.token_bytes(i)) for i in ids) >= 4


def test_end_of_generation_tokens(qwen_path, gemma_path):
    qwen = Tokenizer.from_gguf(open_model(qwen_path))
    gemma = Tokenizer.from_gguf(open_model(gemma_path))
    assert qwen.tokens.index("<|im_end|>") in qwen.eog_ids
    assert gemma.tokens.index("<end_of_turn>") in gemma.eog_ids and gemma.eos_id in gemma.eog_ids
