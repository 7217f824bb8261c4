"""Tokenizers built from the GGUF's own vocabulary, matching llama.cpp id for id.

- tokenizer.ggml.model = "gpt2" (Qwen2/3, Llama 3): byte-level BPE through HF `tokenizers`, with the
  pre-tokenizer regex llama.cpp picks for `tokenizer.ggml.pre` (qwen2's; llama3's, which groups
  digits by three and takes a pre-token that is a whole vocabulary entry as it is; dbrx's; tekken's
  and gpt-4o's, which split CamelCase; gpt-2's, smollm's, falcon's, DeepSeek's three, and its
  default for files that name none).
- tokenizer.ggml.model = "llama" (Gemma-3): SentencePiece BPE through `sentencepiece`, from a
  ModelProto we build from the GGUF's pieces and scores.

A vocabulary it does not know (another pre-tokenizer or tokenizer model: `Tokenizer.lacks`) is
tokenized by llama.cpp's own load of it (`Tokenizer.delegate_to`), so any engine still sees
llama.cpp's ids.

Special tokens are split out first, exactly as llama.cpp's tokenizer_st_partition does: longest
first; user-defined tokens always, control tokens only when `special=True`.
"""
from __future__ import annotations

import codecs
import ctypes
import os
from functools import cached_property
from pathlib import Path
from typing import Sequence


from core.paths import cache_dir
from models.errors import BadInputError

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's "qwen2" pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_QWEN2)
QWEN2_PRETOKENIZE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ... and its "llama3" one (LLAMA_VOCAB_PRE_TYPE_LLAMA3): numbers in runs of up to three digits
LLAMA3_PRETOKENIZE = QWEN2_PRETOKENIZE.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# ... its "tekken" one (Mistral Nemo and later): words split where a lower-case letter meets an upper-case
# one, as llama.cpp writes it (a letter outside a-z counts as upper case, outside A-Z as lower case),
# single digits, and "/" kept with the punctuation before it
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
TEKKEN_PRETOKENIZE = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
                      + _TAIL)
# ... and its "gpt-4o" one (Phi-4-mini, Llama 4): tekken's words with English contractions, digits by three
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
GPT4O_PRETOKENIZE = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
                     rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}|\p{{N}}{{1,3}}" + _TAIL)
# ... its "gpt-2" one, and its "smollm" one (SmolLM2), which first splits every digit off
GPT2_PRETOKENIZE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
SMOLLM_PRETOKENIZE = (r"\p{N}", GPT2_PRETOKENIZE)
# ... its "default" one (a file without tokenizer.ggml.pre) and its "falcon" one: runs of punctuation
# first, then GPT-2's words, then digits by three
DEFAULT_PRETOKENIZE = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_PRETOKENIZE, r"\p{N}+", r"[0-9][0-9][0-9]")
FALCON_PRETOKENIZE = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_PRETOKENIZE, r"[0-9][0-9][0-9]")
# ... DeepSeek's: "deepseek-llm" (DeepSeek LLM 7B/67B) and "deepseek-coder" (DeepSeek-Coder V1) split
# lines, words (with one space before), punctuation, CJK and Hangul runs and numbers in turn;
# "deepseek-v3" (DeepSeek V3/R1) numbers by three, CJK and kana runs, then words with their marks
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
DEEPSEEK_LLM_PRETOKENIZE = (
    r"[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-"
    "\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-"
    "\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-"
    "\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
    "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-"
    "\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
)
DEEPSEEK_CODER_PRETOKENIZE = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
DEEPSEEK3_PRETOKENIZE = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# tokenizer.ggml.pre -> (regex, or regexes applied one after the other to each piece, ignore_merges,
# add_bos when the file does not say), as llama-vocab.cpp maps the names (a pre-token that is itself
# in the vocabulary is taken whole under ignore_merges)
BPE_PRETOKENIZERS = {
    **{name: (QWEN2_PRETOKENIZE, False, False) for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
    **{name: (LLAMA3_PRETOKENIZE, True, True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{name: (LLAMA3_PRETOKENIZE, False, False) for name in ("dbrx", "smaug-bpe")},
    "tekken": (TEKKEN_PRETOKENIZE, True, True),
    **{name: (GPT4O_PRETOKENIZE, False, False) for name in ("gpt-4o", "llama4")},
    **{name: (GPT2_PRETOKENIZE, False, False) for name in ("gpt-2", "phi-2", "mpt", "olmo")},
    **{name: (SMOLLM_PRETOKENIZE, False, False) for name in ("smollm", "starcoder", "refact", "codeshell", "command-r",
                                                                "exaone", "minerva-7b")},
    "default": (DEFAULT_PRETOKENIZE, False, False),
    "falcon": (FALCON_PRETOKENIZE, False, False),
    "deepseek-llm": (DEEPSEEK_LLM_PRETOKENIZE, False, False),
    "deepseek-coder": (DEEPSEEK_CODER_PRETOKENIZE, False, False),
    "deepseek-v3": (DEEPSEEK3_PRETOKENIZE, False, False),
}
TOKENIZER_MODELS = ("gpt2", "llama")     # tokenizer.ggml.model values kvchat tokenizes itself


def vocabulary_lacks(model: str | None, pre: str | None) -> str | None:
    """What of a GGUF's vocabulary kvchat's tokenizer cannot split as llama.cpp does ("tokenizer model
    'rwkv'", "pre-tokenizer 'viking'"), or None. llama.cpp's own load of such a vocabulary tokenizes
    it (Tokenizer.delegate_to). A file without a pre-tokenizer name gets llama.cpp's default."""
    if model not in TOKENIZER_MODELS:
        return f"tokenizer model '{model}'"
    if model == "gpt2" and not (pre is None or isinstance(pre, str) and pre in BPE_PRETOKENIZERS):
        return f"pre-tokenizer '{pre}'"
    return None
# Texts llama.cpp treats as end-of-generation whatever the GGUF's eos says, and types as control
# tokens whatever the GGUF's types say (llama-vocab.cpp, llama_vocab::impl::load)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
# ... and so are the fill-in-the-middle pad, repo and file-separator tokens, the file's own
# (tokenizer.ggml.fim_*_token_id) or else the first of these texts the vocabulary has
FIM_EOG_TEXTS = {"pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                 "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                 "sep": ("<|file_sep|>",)}


def llama_eog(tokens: Sequence[str], types: list[int], ids: Sequence[int | None],
              fim_ids: dict[str, int | None]) -> frozenset[int]:
    """The token ids that end generation, as llama.cpp's vocabulary loader picks them (ids: eos,
    eot, eom), with its two exceptions: o200k_harmony's and solar-open's `<|end|>` is not one when
    `<|return|>` / `<|call|>` (or `<|calls|>` / `<|flush|>`) are, and a `</s>` beside
    `<|tool_response>` or `<|plamo:eos|>` is a normal token. Retypes tokens in `types` as llama.cpp
    does: each of these control (the two exceptions user-defined / normal), and gpt-oss's
    `<|channel|>`, `<|message|>`, `<|start|>`, `<|constrain|>` user-defined."""
    index = {t: i for i, t in enumerate(tokens)}
    eog = set()
    for kind, texts in FIM_EOG_TEXTS.items():
        i = fim_ids.get(kind)
        if not isinstance(i, int):          # absent (or, in an untrusted file, not an id): by its text
            i = next((index[t] for t in texts if t in index), None)
            if i is not None:
                types[i] = CONTROL
        if i is not None:
            eog.add(i)
    for t in EOG_TEXTS:
        if t in index:
            eog.add(index[t])
            types[index[t]] = CONTROL
    for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):   # gpt-oss's, always rendered
        if t in index:
            types[index[t]] = USER_DEFINED
    eog |= {i for i in ids if isinstance(i, int)}
    texts = {tokens[i] for i in eog if 0 <= i < len(tokens)}
    if "<|end|>" in texts and texts & {"<|call|>", "<|calls|>"} and texts & {"<|return|>", "<|flush|>"}:
        eog.discard(index["<|end|>"])
        types[index["<|end|>"]] = USER_DEFINED
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        eog.discard(index["</s>"])
        types[index["</s>"]] = NORMAL
    return frozenset(i for i in eog if 0 <= i < len(tokens))


_C_SPACE = " \t\n\v\f\r"      # C's isspace


def _rstrip_ids(tokens: Sequence[str], types: list[int], name: str | None) -> frozenset[int]:
    """The special tokens that take the whitespace after them along: llama.cpp gives every special
    token of a model whose general.name says Phi-3 ("phi-3" or "phi3", any case) that attribute,
    and "</s>", but not "<unk>", "<s>" and "<|endoftext|>" (llama_vocab::impl::load)."""
    if not isinstance(name, str) or not any(k in name.lower() for k in ("phi-3", "phi3")):
        return frozenset()
    special = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN)}
    special |= {i for i, t in enumerate(tokens) if t == "</s>"}
    return frozenset(i for i in special if tokens[i] not in ("<unk>", "<s>", "<|endoftext|>"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """encode/decode for one GGUF vocabulary. Build it with `Tokenizer.from_gguf(gguf_file)`."""

    def __init__(self, model: str, tokens: list[str], types: list[int], scores: list[float] | None,
                 merges: list[str] | None, bos_id: int | None, eos_id: int | None, add_bos: bool,
                 add_space_prefix: bool, eot_id: int | None = None, unk_id: int | None = None,
                 cache_key: str | None = None, pre: str | None = None, eom_id: int | None = None,
                 fim_ids: dict[str, int | None] | None = None, name: str | None = None):
        self.model = model
        self.tokens = tokens
        types = list(types)
        self.eog_ids = llama_eog(tokens, types, (eos_id, eot_id, eom_id), fim_ids or {})   # (retypes some)
        self.types = types
        self.n_vocab = len(tokens)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        self.unk_id = unk_id
        self._cache_key = cache_key
        self._piece_cache: dict[int, bytes] = {}
        # (text, id, is_control, rstrip) longest first: the order llama.cpp tries them in
        rstrip = _rstrip_ids(tokens, types, name)
        specials = [(t, i, types[i] in (CONTROL, UNKNOWN), i in rstrip) for i, t in enumerate(tokens)
                    if types[i] in (CONTROL, USER_DEFINED, UNKNOWN) and t]
        self._specials = sorted(specials, key=lambda s: -len(s[0]))
        # what kvchat cannot split as llama.cpp does (from_gguf then hands the splitting to llama.cpp: delegate_to)
        self.lacks = vocabulary_lacks(model, pre)
        self._llama = self._llama_vocab = None      # llama.cpp's load of the vocabulary (delegate_to)
        if self.lacks is None and model == "gpt2":
            self._init_bpe(merges or [], pre or "default")
        elif self.lacks is None:
            self._init_spm(scores or [0.0] * len(tokens))

    @classmethod
    def from_gguf(cls, g) -> "Tokenizer":
        """(A vocabulary kvchat does not tokenize itself is llama.cpp's: delegate_to.)"""
        tokens = g.get("tokenizer.ggml.tokens")
        if not tokens:
            raise BadInputError(f"{g.path.name} has no tokenizer vocabulary")
        model, pre = g.get("tokenizer.ggml.model"), g.get("tokenizer.ggml.pre")
        types = g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        bos_by_default = model == "llama" or (model == "gpt2" and pre in BPE_PRETOKENIZERS and BPE_PRETOKENIZERS[pre][2])
        tokenizer = cls(
            model=model, tokens=tokens, types=list(types), scores=g.get("tokenizer.ggml.scores"),
            merges=g.get("tokenizer.ggml.merges"),
            bos_id=g.get("tokenizer.ggml.bos_token_id"), eos_id=g.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(g.get("tokenizer.ggml.add_bos_token", bos_by_default)),
            add_space_prefix=bool(g.get("tokenizer.ggml.add_space_prefix", model == "llama")),
            eot_id=g.get("tokenizer.ggml.eot_token_id"), unk_id=g.get("tokenizer.ggml.unknown_token_id"),
            cache_key=f"{g.path.stem}-{g.file_size}-{int(g.path.stat().st_mtime)}",
            pre=pre, eom_id=g.get("tokenizer.ggml.eom_token_id"),
            fim_ids={kind: g.get(f"tokenizer.ggml.fim_{kind}_token_id") for kind in FIM_EOG_TEXTS},
            name=g.get("general.name"),
        )
        if tokenizer.lacks is not None:
            tokenizer.delegate_to(g.path)
        return tokenizer

    # --- backends ---------------------------------------------------------------------------
    def _init_bpe(self, merges: list[str], pre: str | None) -> None:
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(self.tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        regex, ignore_merges, _ = BPE_PRETOKENIZERS[pre]
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                    ignore_merges=ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
              for r in ((regex,) if isinstance(regex, str) else regex)),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        self._hf = hf
        self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}

    def _init_spm(self, scores: Sequence[float]) -> None:
        """Building the ModelProto for a 262k vocabulary takes a second in Python, so the serialized
        proto is cached in the user cache dir, keyed by the GGUF file's name, size and mtime."""
        import sentencepiece as spm

        cached = cache_dir() / "tokenizers" / f"{self._cache_key}.spm" if self._cache_key else None
        if cached is not None and cached.exists():
            proto_bytes = cached.read_bytes()
        else:
            proto_bytes = self._spm_proto(scores)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_suffix(f".tmp{os.getpid()}")
                tmp.write_bytes(proto_bytes)
                os.replace(tmp, cached)
        self._sp = spm.SentencePieceProcessor(model_proto=proto_bytes)

    def _spm_proto(self, scores: Sequence[float]) -> bytes:
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.trainer_spec.model_type = pb.TrainerSpec.BPE
        proto.trainer_spec.byte_fallback = True
        proto.trainer_spec.vocab_size = len(self.tokens)
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = False      # llama.cpp adds the space prefix itself
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = True
        # Special tokens are partitioned out before SentencePiece sees the text; inside raw text
        # llama.cpp's merges may reach any non-control piece, so user-defined ones count as normal.
        sp_type = {NORMAL: 1, UNKNOWN: 2, CONTROL: 3, USER_DEFINED: 1, UNUSED: 5, BYTE: 6}
        # SentencePiece needs exactly one unknown piece: the GGUF's unknown_token_id, else the first UNKNOWN.
        unk = self.unk_id if self.unk_id is not None else next((i for i, k in enumerate(self.types) if k == UNKNOWN), None)
        if unk is None or not 0 <= unk < len(self.tokens):
            raise BadInputError("SentencePiece vocabulary has no unknown token")
        for i, (text, kind) in enumerate(zip(self.tokens, self.types)):
            piece = proto.pieces.add()
            piece.piece = text
            piece.score = float(scores[i])
            t = sp_type.get(kind, 1)
            piece.type = 2 if i == unk else (3 if t == 2 else t)
        return proto.SerializeToString()

    def delegate_to(self, path) -> None:
        """Tokenize with llama.cpp's own load of this GGUF's vocabulary from now on: a vocabulary
        kvchat lacks (self.lacks) is still split, shown and counted exactly as llama.cpp does, so
        every engine (kvchat's too) sees llama.cpp's ids."""
        import logging

        import llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        log = logging.getLogger("llama-cpp-python")     # (where llama-cpp-python sends llama.cpp's log)
        level = log.level
        log.setLevel(logging.CRITICAL)
        try:
            model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        finally:
            log.setLevel(level)
        if not model:
            raise BadInputError(f"kvchat does not tokenize {self.lacks}, and llama.cpp could not load the "
                                f"vocabulary of {Path(path).name} either")
        self._llama = model                 # (freed with the tokenizer)
        self._llama_vocab = llama_cpp.llama_model_get_vocab(model)
        self._piece_cache.clear()
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._llama_vocab))

    def __del__(self):
        if getattr(self, "_llama", None):
            import llama_cpp
            llama_cpp.llama_model_free(self._llama)
            self._llama = None

    def _llama_encode(self, text: str, special: bool) -> list[int]:
        import llama_cpp
        raw = text.encode()
        n = len(raw) + 2
        while True:
            out = (llama_cpp.llama_token * n)()
            got = llama_cpp.llama_tokenize(self._llama_vocab, raw, len(raw), out, n, False, special)
            if got >= 0:
                return list(out[:got])
            n = -got

    def _piece_bytes(self, token_id: int) -> bytes:
        """What a token stands for, as bytes (computed on first use: most ids are never decoded)."""
        raw = self._piece_cache.get(token_id)
        if raw is None and self._llama_vocab is not None:
            import llama_cpp
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self._llama_vocab, token_id, buf, 64, 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self._llama_vocab, token_id, buf, -n, 0, True)
            raw = self._piece_cache[token_id] = buf.raw[:max(n, 0)]
        if raw is None:
            text, kind = self.tokens[token_id], self.types[token_id]
            if kind in (CONTROL, UNKNOWN, UNUSED, USER_DEFINED):
                raw = text.encode()
            elif self.model == "gpt2":
                raw = bytes(self._byte_of.get(c, 0) for c in text)
            elif kind == BYTE and len(text) == 6 and text.startswith("<0x"):
                raw = bytes([int(text[3:5], 16)])
            else:
                raw = text.replace("\u2581", " ").encode()
            self._piece_cache[token_id] = raw
        return raw

    # --- encoding ---------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        """Text -> ids. `special=True` parses control tokens written in the text (for chat templates)."""
        ids = [self.bos_id] if add_bos and self.bos_id is not None else []
        if self._llama_vocab is not None:
            return ids + self._llama_encode(text, special)
        if self.lacks is not None:
            raise BadInputError(f"kvchat does not tokenize {self.lacks} (Tokenizer.from_gguf hands it to llama.cpp)")
        prev_special = True
        for fragment in self._partition(text, special):
            if isinstance(fragment, int):
                ids.append(fragment)
                prev_special = True
                continue
            if self.model == "gpt2":
                ids.extend(self._hf.encode(fragment, add_special_tokens=False).ids)
            else:
                if self.add_space_prefix and prev_special:
                    fragment = " " + fragment
                ids.extend(self._sp.encode(fragment.replace(" ", "\u2581")))
            prev_special = False
        return ids

    def _partition(self, text: str, special: bool) -> list[str | int]:
        fragments: list[str | int] = [text]
        for token_text, token_id, is_control, rstrip in self._specials:
            if is_control and not special:
                continue
            if token_text not in text:
                continue
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or token_text not in frag:
                    out.append(frag)
                    continue
                parts = frag.split(token_text)
                for j, part in enumerate(parts):
                    if j:
                        out.append(token_id)
                        if rstrip:                      # the whitespace after it goes with it
                            part = part.lstrip(_C_SPACE)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    # --- decoding ---------------------------------------------------------------------------
    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes a token stands for. Control tokens render as nothing unless `special`."""
        if not 0 <= token_id < self.n_vocab:
            return b""
        if self.types[token_id] in (CONTROL, UNKNOWN, UNUSED) and not special:
            return b""
        return self._piece_bytes(token_id)

    def piece(self, token_id: int) -> str:
        """A token's text for display (invalid UTF-8 shown with replacement characters)."""
        return self.token_bytes(token_id, special=True).decode("utf-8", errors="replace")

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        text = b"".join(self.token_bytes(i, special) for i in ids).decode("utf-8", errors="replace")
        return text

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns ids into text one at a time without ever emitting half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    def getstate(self) -> tuple:
        """The pending partial character, to back off to (banned strings)."""
        return self._utf8.getstate()

    def setstate(self, state: tuple) -> None:
        self._utf8.setstate(state)


