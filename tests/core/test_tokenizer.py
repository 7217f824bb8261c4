"""Our tokenizers must give llama.cpp's ids exactly, for every registry model."""
import llama_cpp
import pytest

from core.tokenizer import Tokenizer
from models.errors import BadInputError
from models.gguf_file import open_model
from tests.engine.conftest import byte_level_bpe

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


def _vocab_copy(src, dst, pre: str, extra_tokens: list[str], extra_merges: list[str]):
    """A vocabulary-only GGUF: the registry model's metadata with another pre-tokenizer and a few
    tokens and merges appended (gguf's own reader and writer)."""
    import gguf
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.get_field("general.architecture").contents())
    extra = {"tokenizer.ggml.pre": lambda v: pre, "tokenizer.ggml.tokens": lambda v: list(v) + extra_tokens,
             "tokenizer.ggml.token_type": lambda v: list(v) + [1] * len(extra_tokens),
             "tokenizer.ggml.merges": lambda v: list(v) + extra_merges}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = extra.get(name, lambda v: v)(field.contents())
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return dst


@pytest.mark.real_model
def test_llama3_pre_tokenizer_is_llamacpps(qwen_path, tmp_path):
    """Llama 3's BPE pre-tokenizer (tokenizer.ggml.pre "llama-bpe"): digits in runs of up to three
    and a pre-token that is itself a token taken whole (ignore_merges). The Qwen vocabulary with
    "12", "123", "45" (and their merges) and "678" (no merges) appended shows both, id for id."""
    path = _vocab_copy(qwen_path, tmp_path / "llama3-vocab.gguf", "llama-bpe", ["12", "123", "45", "678"],
                       ["1 2", "12 3", "4 5"])
    ours = Tokenizer.from_gguf(open_model(path))
    theirs = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in CORPUS[:12] + ["1234567890 678 12345678 99"]:
            want = theirs.tokenize(text.encode(), add_bos=False, special=False)
            assert ours.encode(text, add_bos=False) == want, text
        ids = ours.encode("1234567890 678", add_bos=False)
        assert ours.tokens.index("123") in ids and ours.tokens.index("678") in ids   # grouped, and taken whole
    finally:
        theirs.close()


def vocab_only(path, tokens: list[str], types: list[int], model: str = "gpt2", keys: dict | None = None,
               **writer) -> tuple[Tokenizer, "llama_cpp.Llama"]:
    """A vocabulary-only GGUF (llama architecture, no tensors) -> (our tokenizer of it, llama.cpp's
    vocab_only load of it; close it). keys: more uint32 keys by full name; writer: GGUFWriter.add_<name>
    calls (pre="qwen2" -> add_tokenizer_pre, merges, scores, name, bos_token_id, ...)."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(64)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    adders = {"pre": w.add_tokenizer_pre, "merges": w.add_token_merges, "scores": w.add_token_scores}
    for name, value in writer.items():
        if value is None:           # (a key the file leaves out)
            continue
        adders.get(name, getattr(w, f"add_{name}", None))(value)
    for key, value in (keys or {}).items():
        w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return (Tokenizer.from_gguf(open_model(path)),
            llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False))


def _llama_cpp_eog(theirs) -> set[int]:
    vocab = llama_cpp.llama_model_get_vocab(theirs.model)
    return {i for i in range(theirs.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}


def test_end_of_generation_tokens_are_llama_cpps(pair):
    """The tokens that end a reply: llama.cpp's set exactly (qwen2.5-coder's include its
    fill-in-the-middle pad, repo-name and file-separator tokens)."""
    ours, theirs = pair
    assert ours.eog_ids == _llama_cpp_eog(theirs)


EOG_VOCABS = {
    # Llama 3's <|end_of_text|> typed NORMAL, FIM tokens by text, an eom id from the file
    "llama3-like": (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|fim_pad|>", "<PAD>",
                     "<|repo_name|>", "<|file_sep|>", "<|end|>"], {"tokenizer.ggml.eom_token_id": 3}),
    # o200k_harmony: <|end|> is not one when <|return|> and <|call|> are
    "harmony-like": (["<|start|>", "<|end|>", "<|return|>", "<|call|>", "<|message|>"], {}),
    # the file names its FIM pad: the text search is skipped
    "fim-key": (["<|fim_pad|>", "<fim-pad>", "<|endoftext|>", "</s>", "<eos>"], {"tokenizer.ggml.fim_pad_token_id": 1}),
}


@pytest.mark.parametrize("name", EOG_VOCABS)
def test_end_of_generation_rules_on_small_vocabularies(tmp_path, name):
    """llama.cpp's rules beyond the registry's vocabularies, on vocabulary-only GGUFs: texts that end
    generation whatever their type, FIM tokens, the file's eom and FIM ids, and the harmony
    exception. Every special text here is typed NORMAL in the file."""
    extra, keys = EOG_VOCABS[name]
    tokens = [chr(ord("a") + i) for i in range(26)] + ["ab"] + extra
    ours, theirs = vocab_only(tmp_path / "v.gguf", tokens, [1] * len(tokens), keys=keys, pre="qwen2",
                              merges=["a b"], eos_token_id=0)
    try:
        expected = _llama_cpp_eog(theirs)
        assert ours.eog_ids == expected
        assert len(expected) >= 3
        text = "".join(extra)        # and the retyped tokens split a text as llama.cpp's do
        assert ours.encode(text, special=True) == theirs.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        theirs.close()


PRE_CORPUS = CORPUS + [
    "CamelCaseWordsLikeThis and HTTPServer, getHTTPResponseCode(); XMLHttpRequest iPhone McDonald",
    "paths a/b/c, ./run.sh --flag=/tmp/x; http://example.com/a?b=c&d=1 :/ ;/",
    "It's DON'T we'LL they've I'M you'd SHE'S O'Neil rock'n'roll",
    "digits 1 12 123 1234 12345 123456 1234567 v2.10.3 3x4 x86_64 ÉCOLE Élan naïve ÜberMensch",
    "Ελληνικά ‘single’ “double” «guillemets» µs 5\u212a café cafe\u0301 € ± → © ½ ² ① Ⅻ ٣४ ＡＢＣ！ｘｙｚ　全角。"
    " ひらがな カタカナ ﬃ Ꙁ 𐐀𐐨 ok!? $+<=>^`|~ end  ",
]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "dbrx", "tekken", "gpt-4o", "gpt-2", "smollm", "command-r", "exaone",
                                 "falcon", "deepseek-llm", "deepseek-coder", "deepseek-v3", "default", None])
def test_bpe_pre_tokenizers_split_as_llama_cpp(tmp_path, pre):
    """Each pre-tokenizer name we know (Qwen, Llama 3, Phi-4's dbrx, Mistral Nemo's tekken,
    Phi-4-mini's gpt-4o, GPT-2's, SmolLM2's, Command-R's, Falcon's, DeepSeek's three, llama.cpp's
    default, which a file without the key gets) gives llama.cpp's ids on a vocabulary whose merges
    cross word, case, digit, script and punctuation boundaries; and the add-BOS default it implies
    when the file does not say."""
    tokens, merges = byte_level_bpe(PRE_CORPUS, 700)
    tokens.append("<|endoftext|>")
    ours, theirs = vocab_only(tmp_path / "v.gguf", tokens, [1] * (len(tokens) - 1) + [3], pre=pre, merges=merges,
                              bos_token_id=len(tokens) - 1, eos_token_id=len(tokens) - 1)
    try:
        for text in PRE_CORPUS:
            assert ours.encode(text) == theirs.tokenize(text.encode(), add_bos=False, special=False), repr(text)
        assert ours.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(theirs.model)))
    finally:
        theirs.close()
    if pre != "qwen2":     # not vacuous: qwen2's splits give other ids on this vocabulary
        from core import tokenizer as tk
        qwen_split = Tokenizer("gpt2", tokens, [1] * len(tokens), None, merges, None, None, False, False, pre="qwen2")
        assert any(qwen_split.encode(t) != ours.encode(t) for t in PRE_CORPUS), tk.BPE_PRETOKENIZERS[pre]


@pytest.mark.parametrize("name", ["Phi3", "phi-3-mini-4k-instruct", "Phi 3.5 Mini Instruct", None])
def test_phi3_special_tokens_take_the_whitespace_after_them(tmp_path, name):
    """llama.cpp strips the whitespace right of a special token in a model whose general.name says
    Phi-3 ("phi3" or "phi-3"; not "Phi 3.5"), but not after <s>, <unk> or <|endoftext|>: the same
    ids as llama.cpp's for a Phi-3 chat prompt, with and without that name."""
    from tests.engine.conftest import vocab
    tokens, scores, types = vocab()
    for text, kind in (("<|user|>", 3), ("<|end|>", 3), ("<|assistant|>", 3), ("<|endoftext|>", 3), ("<|tool|>", 4)):
        tokens.append(text)
        scores.append(0.0)
        types.append(kind)
    ours, theirs = vocab_only(tmp_path / "v.gguf", tokens, types, "llama", scores=scores, unk_token_id=0,
                              bos_token_id=1, eos_token_id=2, **({"name": name} if name else {}))
    prompt = ("<s> <|user|>\n the cat<|end|>\n\t<|assistant|>  a dog </s> \n<|endoftext|> sat <|tool|>\n on"
              "<unk> mat<|end|>")
    try:
        for special in (True, False):
            assert ours.encode(prompt, special=special) == theirs.tokenize(prompt.encode(), add_bos=False, special=special)
    finally:
        theirs.close()
    stripped = ours.encode("<|user|>\n the cat", special=True)[1:] == ours.encode("the cat")
    assert stripped == (name in ("Phi3", "phi-3-mini-4k-instruct"))


def test_a_vocabulary_we_lack_tokenizes_with_llama_cpps(tmp_path):
    """A pre-tokenizer llama.cpp knows and kvchat does not ("viking"), and a tokenizer model kvchat
    does not build (BERT's word pieces): the tokenizer says what it lacks and hands the splitting
    to llama.cpp's own load of the file, so its ids and pieces are llama.cpp's; built without that
    (not from the file) it refuses to guess."""
    tokens, merges = byte_level_bpe(PRE_CORPUS, 700)
    tokens.append("<|endoftext|>")
    bert = (["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
            + [chr(c) for c in range(33, 127)] + ["the", "##e", "quick", "brown", "fox", "##s", "hello", "world"])
    cases = {"viking": (tokens, dict(pre="viking", merges=merges, eos_token_id=len(tokens) - 1)),
             "bert": (bert, dict(model="bert"))}
    for name, (vocab, writer) in cases.items():
        types = [3 if t.startswith("[") and len(t) > 1 or t == "<|endoftext|>" else 1 for t in vocab]
        ours, theirs = vocab_only(tmp_path / f"{name}.gguf", vocab, types, **writer)
        try:
            assert ours.lacks == ("pre-tokenizer 'viking'" if name == "viking" else "tokenizer model 'bert'")
            for text in PRE_CORPUS:
                for special in (False, True):
                    want = theirs.tokenize(text.encode(), add_bos=False, special=special)
                    assert ours.encode(text, special=special) == want, repr(text)
                ids = theirs.tokenize(text.encode(), add_bos=False, special=True)
                assert b"".join(ours.token_bytes(i, special=True) for i in ids) == theirs.detokenize(ids, special=True)
        finally:
            theirs.close()
    alone = Tokenizer("gpt2", tokens, [1] * len(tokens), None, merges, None, None, False, False, pre="viking")
    with pytest.raises(BadInputError, match="does not tokenize pre-tokenizer 'viking'"):
        alone.encode("hello")
    # not vacuous: the qwen2 split we used to fall back on gives other ids
    qwen_split = Tokenizer("gpt2", tokens, [1] * len(tokens), None, merges, None, None, False, False, pre="qwen2")
    viking, theirs = vocab_only(tmp_path / "v2.gguf", tokens, [1] * len(tokens), pre="viking", merges=merges)
    try:
        assert any(qwen_split.encode(t) != viking.encode(t) for t in PRE_CORPUS)
    finally:
        theirs.close()
