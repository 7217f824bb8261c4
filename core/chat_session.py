"""A chat, apart from any interface: what sending, regenerating, editing and trimming do to a
conversation and its history. The TUI renders a ChatSession and sends it intents; `kvchat run`
trims its prompt with the same policy (fit_prompt).

The history is written as the chat goes: the user's message when sent, the reply started before
its first token, checkpointed while it streams, and finished (complete, stopped or error), so a
crash loses nothing that was generated.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from core.history import History
from core.types import SamplingParams, SpeculativeConfig
from models.errors import BadInputError

CHECKPOINT_S = 0.5        # a streaming reply is saved this often


def prompt_budget(n_ctx: int, reserve: int) -> int:
    """The prompt tokens a context of n_ctx holds with `reserve` tokens left to generate (at most a
    quarter of the context is kept for them): a prompt must be shorter than this."""
    return n_ctx - max(0, min(reserve, n_ctx // 4))


def fit_prompt(engine, messages: Sequence[dict], chat: bool = True, reserve: int = 0) -> tuple[list[int], bool]:
    """Token ids for a conversation that fit the engine's context with `reserve` tokens left to
    generate (prompt_budget). When it does not fit, the oldest whole turns go first (a user message
    and the replies after it); system messages and the last message always stay. Returns (ids,
    truncated). A last message that alone does not fit is an error. `engine` is an Engine or an
    EngineProcess (prompt_ids, n_ctx). A RemoteEngine's prompt is not token ids: it goes whole, and
    the server trims it or refuses it (a one-line error)."""
    from core.remote_engine import is_remote
    if is_remote(engine):
        return engine.prompt_ids([dict(m) for m in messages], chat=chat), False
    msgs = [dict(m) for m in messages]
    budget = prompt_budget(engine.n_ctx, reserve)
    ids = engine.prompt_ids(msgs, chat=chat)
    truncated = False
    while len(ids) >= budget:
        droppable = [i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"]
        if not droppable:
            raise BadInputError(f"the message is {len(ids)} tokens but the context holds {engine.n_ctx} "
                                f"(with {engine.n_ctx - budget} kept free for the reply); shorten it or raise --ctx")
        first = droppable[0]
        end = first + 1
        while end < len(msgs) - 1 and msgs[end]["role"] not in ("user", "system"):
            end += 1
        del msgs[first:end]
        truncated = True
        ids = engine.prompt_ids(msgs, chat=chat)
    return ids, truncated


@dataclass
class Reply:
    """A reply about to be generated: its history row, the prompt and the sampling."""
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    truncated: bool


class DecodeThreads:
    """How many threads the chat decodes with: measured on this machine, not guessed.

    Why: the chat's window needs CPU too. Where decode is memory-bound (AMD Zen here) a thread
    fewer costs decode nothing and keeps Textual's rendering from stalling the engine's parallel
    regions; where it is compute-bound (the Intel Xeon of the README's "Tested on") that thread is
    a third of decode's speed. So the first reply of at least MIN_TOKENS decodes on every core but
    one, the next on all of them, and each later reply on whichever was faster (its best reply).
    KVCHAT_DECODE_THREADS=N forces N."""

    MIN_TOKENS = 16          # shorter replies say little about decode speed

    def __init__(self, cores: int, forced: str | None = None):
        forced = (forced or "").strip()                   # unset or empty: measured
        if forced and not (forced.isdigit() and int(forced) > 0):
            raise BadInputError(f"KVCHAT_DECODE_THREADS must be a positive whole number, got '{forced}'")
        self.forced = int(forced) if forced else None
        self.choices = sorted({max(1, cores - 1), max(1, cores)})
        self.rates: dict[int, float] = {}          # threads -> best decode tokens/s of a reply

    def next(self) -> int:
        if self.forced:
            return self.forced
        untried = [n for n in self.choices if n not in self.rates]
        return untried[0] if untried else max(self.rates, key=self.rates.get)

    def record(self, threads: int, n_tokens: int, per_second: float) -> None:
        if n_tokens >= self.MIN_TOKENS and per_second > 0:
            self.rates[threads] = max(per_second, self.rates.get(threads, 0.0))


@dataclass
class ReplyEnd:
    status: str            # complete | stopped | error
    finish_reason: str
    summary: str           # "N tok · X t/s", or the error


class ChatSession:
    """The open conversation (None until the first message of a new chat), its settings, and the
    message being edited."""

    def __init__(self, history: History):
        self.history = history
        self.conversation_id: int | None = None
        self.params = SamplingParams()               # settings for the next new chat (the last ones used)
        # `kvchat chat --json-schema/--grammar`: every reply of this session follows it, whichever
        # conversation is open (not a stored setting: core.types keeps it off the settings screen)
        self.output_format: dict = {}
        self.new_chat_system_prompt = ""
        self.editing_message_id: int | None = None

    # --- which conversation ----------------------------------------------------------------
    def open(self, conversation_id: int | None) -> list:
        """Open a conversation (None: a new chat); its messages."""
        self.conversation_id = conversation_id
        self.editing_message_id = None
        if conversation_id is None:
            return []
        conv = self.history.get_conversation(conversation_id)
        if conv.settings:
            self.params = SamplingParams.from_settings(conv.settings)
        return self.history.messages(conversation_id)

    def messages(self) -> list:
        return self.history.messages(self.conversation_id) if self.conversation_id is not None else []

    # --- intents ---------------------------------------------------------------------------
    def send(self, text: str, model_name: str, title: str = "") -> tuple[int, int | None]:
        """Add the user's message (replacing the one being edited and all after it). Returns (its id,
        the id from which messages were dropped, or None). A new chat is named by `title`, else by
        the text's start (a message that opens with attached files passes its question)."""
        dropped = None
        if self.editing_message_id is not None:
            self.history.delete_messages_from(self.conversation_id, self.editing_message_id)
            dropped, self.editing_message_id = self.editing_message_id, None
        if self.conversation_id is None:
            title = " ".join((title or text).split())[:48] or "New chat"
            self.conversation_id = self.history.create_conversation(
                title, self.new_chat_system_prompt, model_name, self.params.settings())
            self.new_chat_system_prompt = ""
        return self.history.add_message(self.conversation_id, "user", text), dropped

    def drop_last_reply(self) -> int | None:
        """Regenerate's first half: delete the last reply, if the chat ends with one; its id."""
        msgs = self.messages()
        if msgs and msgs[-1].role == "assistant":
            self.history.delete_messages_from(self.conversation_id, msgs[-1].id)
            return msgs[-1].id
        return None

    def start_edit(self) -> str | None:
        """Edit the last user message: its text (None when there is none)."""
        users = [m for m in self.messages() if m.role == "user"]
        if not users:
            return None
        self.editing_message_id = users[-1].id
        return users[-1].content

    def cancel_edit(self) -> bool:
        editing, self.editing_message_id = self.editing_message_id is not None, None
        return editing

    def rename(self, title: str) -> None:
        self.history.update_conversation(self.conversation_id, title=title.strip())

    def delete(self) -> int | None:
        """Delete the open conversation; the id of the one to show next (None: a new chat)."""
        self.history.delete_conversation(self.conversation_id)
        rest = self.history.list_conversations()
        return rest[0].id if rest else None

    def system_prompt(self) -> str:
        if self.conversation_id is None:
            return self.new_chat_system_prompt
        return self.history.get_conversation(self.conversation_id).system_prompt

    def set_system_prompt(self, text: str) -> None:
        if self.conversation_id is None:
            self.new_chat_system_prompt = text
        else:
            self.history.update_conversation(self.conversation_id, system_prompt=text)

    def check_fits(self, engine, message: str, attachments: Sequence, reserve: int) -> None:
        """Refuse (BadInputError) a message with files that does not fit the context with this
        chat's system prompt, `reserve` tokens left for the reply (core.attachments.check_message_fits)."""
        from core.attachments import check_message_fits
        system = self.system_prompt()
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
        check_message_fits(engine, messages, attachments, engine.has_chat_template, reserve)

    def set_params(self, params: SamplingParams) -> None:
        self.params = params
        if self.conversation_id is not None:
            self.history.update_conversation(self.conversation_id, settings=params.settings())

    def export(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"kvchat-{self.conversation_id}.md"
        path.write_text(self.history.export_conversation(self.conversation_id, "md") + "\n", encoding="utf-8")
        return path

    # --- a reply ---------------------------------------------------------------------------
    def prompt(self, engine) -> tuple[list[int], bool]:
        """The conversation as token ids, trimmed (fit_prompt) to leave room for the reply."""
        conv = self.history.get_conversation(self.conversation_id)
        system = [{"role": "system", "content": conv.system_prompt}] if conv.system_prompt else []
        turns = [{"role": m.role, "content": m.content} for m in self.messages()
                 if m.content and m.status != "error"]
        return fit_prompt(engine, system + turns, chat=engine.has_chat_template, reserve=self.params.max_tokens)

    def begin_reply(self, engine) -> Reply:
        """Prompt, settings and a history row for the next reply. BadInputError if it cannot run."""
        ids, truncated = self.prompt(engine)
        params = replace(self.params, **self.output_format).validate()
        self.history.update_conversation(self.conversation_id, model=engine.model_name)
        return Reply(self.history.start_reply(self.conversation_id, engine.model_name), ids, params, truncated)

    def stream_reply(self, engine, reply: Reply, cancel: threading.Event,
                     speculative: SpeculativeConfig | None, on_text: Callable[[str], None]) -> ReplyEnd:
        """Generate the reply (call from a worker thread): on_text gets each piece of text, the
        history gets checkpoints and the end. Any engine failure ends it as an error, text kept."""
        pieces: list[str] = []
        last_checkpoint = time.monotonic()
        try:
            for event in engine.generate(reply.prompt_ids, reply.params, cancel, speculative):
                if event.text:
                    pieces.append(event.text)
                    on_text(event.text)
                if time.monotonic() - last_checkpoint >= CHECKPOINT_S:
                    self.history.checkpoint_reply(reply.id, "".join(pieces))
                    last_checkpoint = time.monotonic()
            b = engine.backend
            status = "stopped" if b.finish_reason == "cancelled" else "complete"
            self.history.finish_reply(reply.id, "".join(pieces), status,
                                      b.timings.as_dict() | {"finish_reason": b.finish_reason})
            summary = (f"{b.timings.predicted_n} tok · {b.timings.predicted_per_second:.1f} t/s"
                       + ("" if b.finish_reason in ("stop", "cancelled") else f" · {b.finish_reason}"))
            return ReplyEnd(status, b.finish_reason or "", summary)
        except Exception as e:   # noqa: BLE001 - any engine failure becomes the reply's end
            error = str(e) or type(e).__name__
            try:
                self.history.finish_reply(reply.id, "".join(pieces), "error", {"error": error})
            except Exception:    # noqa: BLE001 - the db is gone (app shutting down); nothing to save into
                pass
            return ReplyEnd("error", "error", error)
