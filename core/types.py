"""The records that pass between the layers: what a user asks of a generation (SamplingParams,
SpeculativeConfig), what comes back (TokenEvent, Timings), and the live counters the X-ray reads."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from models.errors import BadInputError

def option(default, kind: type, help: str, hint: str = "", flag: str = "", repeat: bool = False,
           metavar: str | None = None, in_batch: bool = True, in_settings: bool = True):
    """A SamplingParams field and what the interfaces built from it need: its command-line flag (by
    default --field-name), help and a short hint (its settings label), the type of one value,
    whether it repeats, whether a `kvchat batch` line may set it, and whether the chat stores it
    with its settings (a one-line text field on the settings screen)."""
    return field(default=default, metadata={"kind": kind, "help": help, "hint": hint, "flag": flag,
                                            "repeat": repeat, "metavar": metavar, "in_batch": in_batch,
                                            "in_settings": in_settings})


@dataclass(frozen=True)
class SamplingParams:
    """What the user asks of one generation: the one list of sampling options. The flags of `run`,
    `chat` and `batch`, batch lines' fields and the chat's settings screen are made from these fields
    (app/args.py). `validate` refuses values out of range."""
    temperature: float = option(0.8, float, "sampling temperature", "0 = greedy")
    top_k: int = option(40, int, "keep the k most likely tokens", "0 = off")
    top_p: float = option(0.95, float, "keep the smallest set of tokens with this much probability", "1 = off")
    min_p: float = option(0.05, float, "drop tokens below this fraction of the top token's probability", "0 = off")
    repeat_penalty: float = option(1.0, float, "divide the logits of recent tokens by this", "1 = off")
    repeat_last_n: int = option(64, int, "penalty window in tokens")
    presence_penalty: float = option(0.0, float, "subtracted once from the logit of every token seen", "0 = off")
    frequency_penalty: float = option(0.0, float, "subtracted per occurrence of a token seen", "0 = off")
    seed: int | None = option(None, int, "seed for reproducible sampling", "empty = random")
    max_tokens: int = option(512, int, "most tokens to generate; -n as in llama.cpp", flag="-n/--max-tokens")
    stop: tuple[str, ...] = option((), str, "stop string (repeatable); never printed", repeat=True)
    logit_bias: tuple[tuple[int, float], ...] = option(   # (token id, added to its logit); -inf bans it
        (), str, "add BIAS to token ID's logit (repeatable; BIAS may be -inf to ban it)", repeat=True,
        metavar="ID=BIAS", in_batch=False)
    banned: tuple[str, ...] = option(     # strings that must never appear in the output (back off and resample)
        (), str, "a string that must never appear in the output (repeatable): decoding backs off and "
        "resamples where it would start", flag="--ban", repeat=True, metavar="STRING", in_batch=False)
    # Constrained decoding (core.constrained): the output follows a JSON schema (JSON text) or a GBNF
    # grammar. Not a settings-screen field: a schema is a document, not a one-line value.
    json_schema: str | None = option(
        None, str, "the output is JSON valid against this schema (a file, or the schema as inline JSON)",
        metavar="FILE_OR_JSON", in_settings=False)
    grammar: str | None = option(
        None, str, "the output follows this GBNF grammar (a .gbnf file, or inline GBNF)", metavar="FILE",
        in_settings=False)

    def settings(self) -> dict:
        """The single-valued options, as a chat stores them (its settings)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if _is_setting(f)}

    @classmethod
    def from_settings(cls, values: dict) -> "SamplingParams":
        """Stored settings back (fields this version does not know are left out)."""
        known = {f.name for f in fields(cls) if _is_setting(f)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def validate(self) -> "SamplingParams":
        checks = [
            (math.isfinite(self.temperature) and 0 <= self.temperature <= 10, "temperature must be in [0, 10]"),
            (self.top_k >= 0, "top-k must be >= 0"),
            (0 < self.top_p <= 1, "top-p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min-p must be in [0, 1]"),
            (math.isfinite(self.repeat_penalty) and 0 < self.repeat_penalty <= 10, "repeat penalty must be in (0, 10]"),
            (self.repeat_last_n >= 0, "repeat-last-n must be >= 0"),
            (abs(self.presence_penalty) <= 10, "presence penalty must be in [-10, 10]"),
            (abs(self.frequency_penalty) <= 10, "frequency penalty must be in [-10, 10]"),
            (self.max_tokens >= 1, "max tokens must be >= 1"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2^63)"),
            (all(self.stop), "a stop string must not be empty"),
            (all(self.banned), "a banned string must not be empty"),
            (all(t >= 0 and (math.isfinite(b) or b == -math.inf) for t, b in self.logit_bias),
             "logit bias needs a token id >= 0 and a finite bias (or -inf)"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadInputError(message)
        if self.json_schema or self.grammar:
            from core.constrained import check     # (llguidance loads only when a constraint is used)
            check(self)
        return self


def _is_setting(f) -> bool:
    return not f.metadata["repeat"] and f.metadata["in_settings"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it completes (may be "" while a UTF-8 character or a
    possible stop string is held back), and when it was produced (time.perf_counter seconds)."""
    id: int
    text: str
    t: float


@dataclass
class Timings:
    """llama-server's field names, plus ttft_ms (request start to first token)."""
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    ttft_ms: float = 0.0
    cache_n: int = 0               # prompt tokens not computed: reused from memory or restored from disk
    cache_disk_n: int = 0          # of those, the tokens restored from the disk KV cache (core.kv_disk)

    @property
    def prompt_per_second(self) -> float:
        return 1000 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return 1000 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def summary(self) -> str:
        return (f"ttft {self.ttft_ms:.0f} ms | prompt {self.prompt_n} tok, {self.prompt_per_second:.1f} tok/s"
                f" (cached {self.cache_n}{f', {self.cache_disk_n} from disk' if self.cache_disk_n else ''}) | eval {self.predicted_n} tok, {self.predicted_per_second:.1f} tok/s")


SPECULATIVE_METHODS = ("off", "lookup", "draft")


# Most tokens drafted per check by default: prompt lookup adapts its length up to this (see
# core.speculative.LookupDrafter); a draft model stops earlier where it is unsure of its draft
# (core.speculative.DRAFT_MIN_P), so a high cap costs little (README: measured).
DEFAULT_DRAFT_N = {"off": 1, "lookup": 7, "draft": 7}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"            # off | lookup | draft
    draft_n: int | None = None     # most tokens drafted per verification pass; None = the method's default
    draft_model: str | None = None # registry name or path of the draft model (method "draft")

    @property
    def max_draft(self) -> int:
        return DEFAULT_DRAFT_N.get(self.method, 1) if self.draft_n is None else self.draft_n

    def validate(self) -> "SpeculativeConfig":
        if self.method not in SPECULATIVE_METHODS:
            raise BadInputError(f"unknown speculative method '{self.method}' ({', '.join(SPECULATIVE_METHODS)})")
        if self.method == "draft" and not self.draft_model:
            raise BadInputError("--speculative draft needs --draft-model (e.g. qwen2.5-coder-0.5b-instruct)")
        if not 1 <= self.max_draft <= 7:   # 1 + 7 tokens per check stay on the one-token kernels
            raise BadInputError("--draft-n must be between 1 and 7")
        return self


@dataclass
class LiveStats:
    """Counters the engine updates as it works; the TUI's X-ray panel reads them (never estimates)."""
    phase: str = "idle"            # idle | prefill | decode | done
    prefill_done: int = 0
    prefill_total: int = 0
    cache_n: int = 0
    cache_disk_n: int = 0          # of cache_n, restored from the disk KV cache
    n_past: int = 0                # tokens in the KV cache for the current sequence
    n_ctx: int = 0
    token_latencies_ms: list[float] = field(default_factory=list)
    spec_drafted: int = 0          # draft tokens proposed / accepted this turn (speculative decoding)
    spec_accepted: int = 0
