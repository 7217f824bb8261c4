"""Constrained decoding: a JSON schema or a GBNF grammar decides, at every step, which tokens may come
next, so the output always parses (and a schema's output always validates).

The grammar work is llguidance's (the library llama.cpp uses): it compiles a schema or a grammar to
a matcher over our vocabulary and computes the allowed-token bitmask for the whole vocabulary in
native code (tens of microseconds a step), which numpy unpacks in one call. The Sampler
(core.sampler) masks the logits with it before anything else and advances the matcher with each
token it picks, so plain, guarded, speculative and batched decoding are all constrained alike. When
the grammar is complete only the end-of-generation tokens stay allowed: the next token ends the
request (finish_reason "stop").

SamplingParams holds the constraint as text (`json_schema`: JSON, `grammar`: GBNF); `check` compiles
it once without a vocabulary to refuse a bad one with a one-line BadInputError.
"""
from __future__ import annotations

import json
import weakref
from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

import numpy as np

from core.tokenizer import CONTROL, UNKNOWN, USER_DEFINED
from models.errors import BadInputError

if TYPE_CHECKING:
    from core.tokenizer import Tokenizer
    from core.types import SamplingParams

# Whitespace the schema's JSON may have between its tokens: a pretty-printed layout is allowed, an
# endless run is not (under llguidance's default, [ \n\r\t]+, a model that keeps picking whitespace
# never completes the JSON before max_tokens).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"

# One llguidance tokenizer per Tokenizer: building it reads every token's bytes (~0.6 s on a 150k
# vocabulary), so a chat or a batch pays it once.
_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Tokenizer, object]" = weakref.WeakKeyDictionary()


def is_constrained(params: "SamplingParams") -> bool:
    return bool(params.json_schema or params.grammar)


@lru_cache(maxsize=64)
def _compile(json_schema: str | None, grammar: str | None) -> str:
    """The llguidance grammar for a schema or a GBNF grammar; BadInputError (one line) if bad."""
    import llguidance

    if json_schema and grammar:
        raise BadInputError("use one of --json-schema and --grammar, not both")
    try:
        if json_schema:
            schema = json.loads(json_schema)
            if not isinstance(schema, (dict, bool)):
                raise BadInputError("the JSON schema must be a JSON object")
            compiled = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        else:
            compiled = llguidance.grammar_from("gbnf", grammar)
    except json.JSONDecodeError as e:
        raise BadInputError(f"the JSON schema is not valid JSON: {e}") from None
    except ValueError as e:
        raise BadInputError(f"bad {'JSON schema' if json_schema else 'grammar'}: {_one_line(str(e))}") from None
    error = llguidance.LLMatcher.validate_grammar(compiled)
    if error and not error.startswith("WARNING"):
        raise BadInputError(f"bad {'JSON schema' if json_schema else 'grammar'}: {_one_line(error)}")
    return compiled


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.strip().splitlines() if part.strip())


def check(params: "SamplingParams") -> None:
    """Compile the params' schema or grammar (cached): BadInputError if it is bad."""
    if is_constrained(params):
        _compile(params.json_schema, params.grammar)


def schema_from_response_format(response_format) -> str | None:
    """An OpenAI request's `response_format` as SamplingParams.json_schema (for the server):
    {"type": "json_schema", "json_schema": {"schema": {...}}} is that schema, {"type": "json_object"}
    any JSON object, {"type": "text"} or none no constraint. BadInputError for anything else."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, (dict, bool)):
            return json.dumps(schema)
        raise BadInputError("response_format json_schema needs {\"json_schema\": {\"schema\": {...}}}")
    raise BadInputError("response_format type must be text, json_object or json_schema")


def ll_tokenizer(tokenizer: "Tokenizer"):
    """llguidance's view of our vocabulary: every token's bytes (control tokens marked with a 0xFF
    prefix, as llguidance expects, so no grammar text can spell them) and our end-of-generation
    tokens as its EOS set, so any of them ends a completed grammar."""
    cached = _LL_TOKENIZERS.get(tokenizer)
    if cached is not None:
        return cached
    import llguidance

    tokens = [(b"\xff" if _is_special(tokenizer, i) else b"") + tokenizer.token_bytes(i, special=True)
              for i in range(tokenizer.n_vocab)]

    byte_ids: dict[int, int] = {}            # byte -> a token that is that one byte
    for i, raw in enumerate(tokens):
        if len(raw) == 1:
            byte_ids.setdefault(raw[0], i)

    class _Vocabulary:                       # what llguidance.TokenizerWrapper reads
        eos_token_id = min(tokenizer.eog_ids) if tokenizer.eog_ids else tokenizer.eos_id
        bos_token_id = tokenizer.bos_id

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text: bytes) -> list[int]:
            """Tokens that spell exactly `text` (llguidance forces them where the grammar allows
            nothing else): our encoding when it does, else one byte token per byte (a SentencePiece
            vocabulary adds a leading space; a partial UTF-8 character does not decode)."""
            ids = tokenizer.encode(text.decode("utf-8", errors="replace"))
            if b"".join(tokens[i] for i in ids) == text or not all(b in byte_ids for b in text):
                return ids
            return [byte_ids[b] for b in text]

    made = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary()), n_vocab=tokenizer.n_vocab,
                                  eos_token=sorted(tokenizer.eog_ids) or None)
    _LL_TOKENIZERS[tokenizer] = made
    return made


def _is_special(tokenizer: "Tokenizer", i: int) -> bool:
    """Control and unknown tokens, and user-defined ones that look like them ("<tool_call>"): the
    tokens llama.cpp hides from grammars too."""
    kind, text = tokenizer.types[i], tokenizer.tokens[i]
    return kind in (CONTROL, UNKNOWN) or (kind == USER_DEFINED and text.startswith("<") and text.endswith(">"))


class Constraint:
    """One request's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, params: "SamplingParams", tokenizer: "Tokenizer"):
        import llguidance

        self.n_vocab = tokenizer.n_vocab
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), _compile(params.json_schema, params.grammar))
        self._raise_on_error()
        self._bits = np.full((self.n_vocab + 31) // 32, -1, dtype=np.int32)   # (ceil(V/32),) one bit a token

    def allowed(self, n: int) -> np.ndarray:
        """(n,) bool: the tokens the grammar allows next (ids past the vocabulary never)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._raise_on_error()
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")      # (32 * ceil(V/32),)
        if n <= self.n_vocab:
            return bits[:n].astype(bool)
        out = np.zeros(n, dtype=bool)
        out[:self.n_vocab] = bits[:self.n_vocab]
        return out

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """(V,) logits with every token the grammar disallows at -inf (a new array)."""
        return np.where(self.allowed(len(logits)), logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def advance(self, token: int) -> None:
        """The token was chosen: the grammar moves past it."""
        if not self.matcher.consume_token(int(token)):
            self._raise_on_error()
            raise BadInputError(f"token {token} does not fit the grammar")

    def rollback(self, n_tokens: int) -> None:
        """Forget the last n_tokens advanced (a banned string's back-off)."""
        if n_tokens and not self.matcher.rollback(n_tokens):
            self._raise_on_error()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a speculative draft the grammar allows from here: the rest
        would be rejected anyway, so they are not verified."""
        return self.matcher.validate_tokens([int(t) for t in tokens]) if tokens else 0

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            raise BadInputError(f"constrained decoding failed: {_one_line(self.matcher.get_error())}")
