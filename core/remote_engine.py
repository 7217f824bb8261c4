"""A model served by an OpenAI-compatible server (vLLM, llama-server, Ollama, another kvchat), with
Engine's surface as `run`, `batch` and the chat use it (`--backend openai --base-url URL`).

A remote model has no local GGUF or tokenizer, so it is not a token-level Backend: prompt_ids returns
an opaque prompt (the messages for a chat, the text for plain completion) that generate sends to the
server's streaming endpoint (/v1/chat/completions, or /v1/completions). TokenEvents carry id -1 (the
server gives no ids) and one chunk of text each. Timings come from the server's `timings` field where
it sends one (llama-server and kvchat serve), else from `usage` and times measured here. The server
trims or refuses a prompt over its context; kvchat does not count tokens for it.

Every failure (connection refused, DNS, timeout, a 4xx/5xx answer, the connection lost mid-reply) is
a BadInputError of one line naming the URL and the server's message; the text that arrived before it
has already been yielded.
"""
from __future__ import annotations

import math
import os
import threading
import time
from typing import Iterator, Sequence

from core.chat_template import transcript
from core.backend import Capabilities, Described
from core.types import LiveStats, SamplingParams, SpeculativeConfig, Timings, TokenEvent
from models.errors import BadInputError

REMOTE_DEVICE = "remote"
UNKNOWN_CTX = 2**31 - 1          # n_ctx when the server does not say: the server trims or refuses
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0           # between two chunks (a long prefill sends nothing for a while)


def is_remote(engine) -> bool:
    """An engine whose prompts are not token ids (a RemoteEngine, or one seen through a view)."""
    return getattr(engine, "device", None) == REMOTE_DEVICE


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


class RemoteBackend(Described):
    """The backend view of a RemoteEngine: what the X-ray and the status bar read of one generation
    (kv_block_map is empty: "n/a"; there are no decode threads to set)."""
    capabilities = Capabilities(engine="openai", device=REMOTE_DEVICE)

    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx
        self.stats = LiveStats(n_ctx=0 if n_ctx >= UNKNOWN_CTX else n_ctx)
        self.timings = Timings()
        self.finish_reason: str | None = None

    def kv_block_map(self) -> list[str]:
        return []

    def set_decode_threads(self, n: int | None) -> None:
        raise NotImplementedError("the openai backend has no separate decode threads")


def _server_message(e) -> str:
    """The server's own words from an APIStatusError: its body's error message when it has one."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("detail"):
            return str(body["detail"])
    return getattr(e, "message", "") or str(e)


class RemoteEngine:
    """model: the name the server knows the model by (-m); base_url: the server's OpenAI API root,
    e.g. http://127.0.0.1:8080/v1; api_key: --api-key, else OPENAI_API_KEY (a local server takes any).
    Asks the server for its models once (an unreachable server is a BadInputError at once), and
    reads the model's context length from that answer where the server gives it."""

    backend_name = "openai"
    device = REMOTE_DEVICE
    has_chat_template = True         # the server applies the model's template

    def __init__(self, model: str, base_url: str, api_key: str | None = None, timeout: float = READ_TIMEOUT_S):
        import openai
        if not base_url.startswith(("http://", "https://")):
            raise BadInputError(f"--base-url must start with http:// or https:// (got '{base_url}')")
        self.base_url = base_url.rstrip("/")
        self.model_name = model
        self.notes: list[str] = []
        key = api_key or os.environ.get("OPENAI_API_KEY") or "none"
        self.client = openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0,
                                    timeout=openai.Timeout(timeout, connect=CONNECT_TIMEOUT_S))
        self.n_ctx = self._probe()
        self.backend = RemoteBackend(self.n_ctx)

    # --- errors ---------------------------------------------------------------------------
    def error(self, e: BaseException, during: str = "") -> BadInputError:
        """One line for any failure talking to the server."""
        import openai
        where = f"{self.base_url}{during}"
        if isinstance(e, BadInputError):
            return e
        if isinstance(e, openai.APITimeoutError):
            return BadInputError(f"{where}: the server did not answer in time")
        if isinstance(e, openai.APIConnectionError):
            cause = e.__cause__ or e.__context__
            detail = one_line(cause) if cause is not None and str(cause) else one_line(e.message)
            return BadInputError(f"cannot reach {where}: {detail}")
        if isinstance(e, openai.APIStatusError):
            return BadInputError(f"{where} answered {e.status_code}: {one_line(_server_message(e))}")
        return BadInputError(f"{where}: {one_line(str(e) or type(e).__name__)}")

    def _probe(self) -> int:
        """GET /models: the server answers (else a one-line error); the context length it reports
        for this model (vLLM's max_model_len, llama-server's meta.n_ctx_train, kvchat serve's
        n_ctx), else UNKNOWN_CTX. A server without /models (404) is taken at its word later."""
        import openai
        try:
            page = self.client.models.list()
        except openai.NotFoundError:
            return UNKNOWN_CTX
        except Exception as e:   # noqa: BLE001 - every failure is one line
            raise self.error(e, "/models") from None
        for m in page.data:
            if m.id != self.model_name:
                continue
            extra = m.model_extra or {}
            meta = extra.get("meta") if isinstance(extra.get("meta"), dict) else {}
            for value in (extra.get("n_ctx"), extra.get("max_model_len"), meta.get("n_ctx"), meta.get("n_ctx_train")):
                if isinstance(value, int) and value > 0:
                    return value
        return UNKNOWN_CTX

    # --- Engine's surface -------------------------------------------------------------------
    def prompt_ids(self, messages: Sequence[dict] | str, chat: bool = True) -> list[dict] | str:
        """Not token ids: the messages for /chat/completions, or for plain completion (chat False)
        the text (a conversation as a transcript, as Engine writes one for a base model)."""
        if isinstance(messages, str):
            return [{"role": "user", "content": messages}] if chat else messages
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        if chat:
            return [{"role": m["role"], "content": m["content"]} for m in msgs]
        return transcript(msgs)

    def count_tokens(self, text: str) -> int:
        """An estimate (about 4 bytes a token): the server's tokenizer is not here."""
        return max(1, len(text.encode("utf-8")) // 4)

    def request_fields(self, params: SamplingParams) -> dict:
        """SamplingParams as OpenAI request fields; top_k, min_p and the repeat penalty go as extra
        fields (llama-server, vLLM and llama-cpp-python read them; others ignore them). A JSON schema
        is OpenAI's response_format; a GBNF grammar the extra `grammar` field (llama-server's)."""
        fields: dict = {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens,
                        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty}
        if params.stop:
            fields["stop"] = list(params.stop)
        if params.seed is not None:
            fields["seed"] = params.seed
        if params.logit_bias:   # OpenAI's range is [-100, 100]; -100 bans a token
            fields["logit_bias"] = {str(t): (-100.0 if b == -math.inf else max(-100.0, min(100.0, b)))
                                    for t, b in params.logit_bias}
        extra = {"top_k": params.top_k, "min_p": params.min_p,
                 "repeat_penalty": params.repeat_penalty, "repeat_last_n": params.repeat_last_n}
        schema = getattr(params, "json_schema", None)
        if schema:     # OpenAI's structured output; the server constrains its decoding
            import json
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": json.loads(schema)}}
        grammar = getattr(params, "grammar", None)
        if grammar:    # GBNF: llama-server's and llama-cpp-python's `grammar` field
            extra["grammar"] = grammar
        fields["extra_body"] = extra
        return fields

    def generate(self, prompt, params: SamplingParams, cancel: threading.Event | None = None,
                 speculative: SpeculativeConfig | None = None, backend: RemoteBackend | None = None
                 ) -> Iterator[TokenEvent]:
        """Stream the server's reply to `prompt` (prompt_ids' answer) as TokenEvents; `backend`
        (default self.backend) gets the stats, timings and finish_reason (kvchat batch passes one per
        request, so requests can run at once)."""
        if speculative is not None and speculative.method != "off":
            raise BadInputError("speculative decoding runs on the local engines, not --backend openai")
        if params.banned:
            raise BadInputError("--ban runs on the local engines, not --backend openai")
        b = self.backend if backend is None else backend
        return self._stream(prompt, params, cancel, b)

    def _stream(self, prompt, params: SamplingParams, cancel: threading.Event | None,
                b: RemoteBackend) -> Iterator[TokenEvent]:
        chat = not isinstance(prompt, str)
        b.timings, b.finish_reason = Timings(), None
        b.stats = LiveStats(phase="prefill", n_ctx=b.stats.n_ctx)
        endpoint = "/chat/completions" if chat else "/completions"
        t0 = time.perf_counter()
        t_first = t_last = None
        n_chunks = 0
        usage = timings = None
        stream = None
        done = threading.Event()
        try:
            kw = dict(model=self.model_name, stream=True, stream_options={"include_usage": True},
                      **self.request_fields(params))
            if chat:
                stream = self.client.chat.completions.create(messages=prompt, **kw)
            else:
                stream = self.client.completions.create(prompt=prompt, **kw)
            if cancel is not None:    # a stop while the server is still reading the prompt (no chunk to check at)
                threading.Thread(target=_close_on_cancel, args=(stream, cancel, done), daemon=True).start()
            for chunk in stream:
                extra = chunk.model_extra or {}
                if isinstance(extra.get("timings"), dict):
                    timings = extra["timings"]
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices or ():
                    text = (choice.delta.content if chat else choice.text) or ""
                    if choice.finish_reason:
                        b.finish_reason = choice.finish_reason
                    if text:
                        now = time.perf_counter()
                        b.stats.token_latencies_ms.append(1000 * (now - (t_last or t0)))
                        if t_first is None:
                            t_first = now
                            b.stats.phase = "decode"
                        t_last = now
                        n_chunks += 1
                        yield TokenEvent(-1, text, now)
                if cancel is not None and cancel.is_set():
                    b.finish_reason = "cancelled"
                    break
            if b.finish_reason is None:   # every reply's last chunk has one: the server failed on its side
                raise BadInputError(f"{self.base_url}{endpoint}: the server ended the stream without finishing "
                                    f"the reply ({'after ' + str(n_chunks) + ' chunks' if n_chunks else 'nothing sent'}; "
                                    "a prompt over its context, or an error in its log)")
        except GeneratorExit:
            b.finish_reason = b.finish_reason or "cancelled"
            raise
        except Exception as e:   # noqa: BLE001 - one line, the text so far already yielded
            if cancel is not None and cancel.is_set():    # the stream closed under it: a stop, not a failure
                b.finish_reason = "cancelled"
                return
            b.finish_reason = "error"
            raise self.error(e, endpoint + (" (mid-reply)" if n_chunks else "")) from None
        finally:
            done.set()
            b.finish_reason = "error" if b.finish_reason is None else b.finish_reason
            if stream is not None:
                try:
                    stream.close()
                except Exception:   # noqa: BLE001 - closing a broken connection
                    pass
            b.stats.phase = "done"
            self._fill_timings(b, t0, t_first, t_last, n_chunks, usage, timings)

    @staticmethod
    def _fill_timings(b: RemoteBackend, t0: float, t_first, t_last, n_chunks: int, usage, timings) -> None:
        t = b.timings
        t.ttft_ms = 1000 * (t_first - t0) if t_first is not None else 0.0
        if timings:     # llama-server's names, as Timings has them
            for name in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"):
                value = timings.get(name)
                if isinstance(value, (int, float)) and value >= 0:
                    setattr(t, name, type(getattr(t, name))(value))
        else:
            t.prompt_n = getattr(usage, "prompt_tokens", 0) or 0
            t.prompt_ms = t.ttft_ms if t.prompt_n else 0.0
            cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)
            t.cache_n = cached or 0
            t.predicted_n = getattr(usage, "completion_tokens", 0) or n_chunks
            if t_first is not None and t_last is not None and t.predicted_n > 1:
                t.predicted_ms = 1000 * (t_last - t_first) * t.predicted_n / (t.predicted_n - 1)
        s = b.stats
        s.prefill_total = s.prefill_done = t.prompt_n
        s.cache_n = t.cache_n
        s.n_past = t.prompt_n + t.predicted_n

    def close(self) -> None:
        self.client.close()


def _close_on_cancel(stream, cancel: threading.Event, done: threading.Event) -> None:
    """Close `stream` when `cancel` is set before `done` (the reading thread then stops at once)."""
    while not done.is_set():
        if cancel.wait(0.1):
            if not done.is_set():
                try:
                    stream.close()
                except Exception:   # noqa: BLE001 - already closed
                    pass
            return


def summary(t: Timings) -> str:
    """Timings.summary with n/a where the server did not say (no prompt count, no cache count)."""
    prompt = (f"prompt {t.prompt_n} tok, {t.prompt_per_second:.1f} tok/s (cached {t.cache_n})" if t.prompt_n
              else "prompt n/a")
    return f"ttft {t.ttft_ms:.0f} ms | {prompt} | eval {t.predicted_n} tok, {t.predicted_per_second:.1f} tok/s"
