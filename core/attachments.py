"""Files attached to a message (`kvchat run -f FILE`, the chat's attach prompt): read and checked
once, written into the user message under a header with their name, and refused with one line when
they are not text or do not fit the context.

The files go BEFORE the question: the same document then gives the same leading tokens whatever is
asked about it, so a prefix cache (the KV cache, and the disk KV cache of #25) prefills it once.
"""
from __future__ import annotations

import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from core.chat_session import prompt_budget
from models.errors import BadInputError

# Bigger than any context kvchat runs (about a million tokens of text), and small enough that the
# tokenizer counts it in a few seconds; a bigger file is a log or a dump, not something to ask about.
MAX_BYTES = 4 << 20
BACKTICKS = re.compile(r"`+")


@dataclass(frozen=True)
class Attachment:
    path: Path             # as the user gave it, ~ expanded
    text: str

    @property
    def name(self) -> str:
        return self.path.name

    def block(self) -> str:
        """The file as the message holds it: a header with its name, then its text fenced. The
        fence is longer than any run of backticks in the text, so a Markdown file cannot close it."""
        longest = max((len(run) for run in BACKTICKS.findall(self.text)), default=0)
        fence = "`" * max(3, longest + 1)
        body = self.text if not self.text or self.text.endswith("\n") else self.text + "\n"
        return f"File: {self.name}\n{fence}\n{body}{fence}"


def read_attachment(path: str | Path) -> Attachment:
    """A text file to attach. BadInputError (one line, naming the file) when it is missing, not a
    regular file, too big, binary (a NUL byte) or not valid UTF-8."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise BadInputError(f"{path} is a directory; attach the files in it one by one")
        if not stat.S_ISREG(st.st_mode):
            raise BadInputError(f"{path} is not a regular file")
        if st.st_size > MAX_BYTES:
            raise BadInputError(f"{path} is {st.st_size / 2**20:.1f} MiB; kvchat attaches text files up to "
                                f"{MAX_BYTES >> 20} MiB (more than any context holds)")
        data = p.read_bytes()
    except FileNotFoundError:
        raise BadInputError(f"no such file: {path}") from None
    except OSError as e:
        raise BadInputError(f"cannot read {path}: {e.strerror or e}") from None
    if b"\0" in data:
        raise BadInputError(f"{path} is a binary file; only text files can be attached")
    try:
        text = data.decode("utf-8-sig")     # (a byte-order mark is not text)
    except UnicodeDecodeError as e:
        raise BadInputError(f"{path} is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                            "only UTF-8 text files can be attached") from None
    return Attachment(p, text)


def compose_message(question: str, attachments: Sequence[Attachment]) -> str:
    """The user message: each file's block, then the question (blank lines between)."""
    return "\n\n".join([a.block() for a in attachments] + ([question] if question.strip() else []))


def count_tokens(engine, attachment: Attachment) -> int:
    """The tokens an attachment adds to a message (its block, header included): the chip's number."""
    return engine.count_tokens(attachment.block())


def check_attachment_fits(attachment: Attachment, n_tokens: int, n_ctx: int, reserve: int = 0) -> None:
    """Refuse a file that could never fit, whatever else the message holds (the chat checks this
    when a file is attached, before the user types a question about it)."""
    budget = prompt_budget(n_ctx, reserve)
    if n_tokens >= budget:
        raise BadInputError(f"{attachment.name} is {n_tokens} tokens but the context holds {n_ctx}"
                            f"{_kept_free(n_ctx, budget)}; attach a smaller file or raise --ctx")


def check_message_fits(engine, messages: Sequence[dict], attachments: Sequence[Attachment],
                       chat: bool = True, reserve: int = 0) -> None:
    """Refuse a message whose attachments do not fit: its system prompts and the message itself,
    all that fit_prompt never drops, must leave `reserve` tokens for the reply. The error gives the
    message's tokens, each file's and the context's size (fit_prompt's own error would not name
    the files). `messages` ends with the user message that holds the attachments."""
    from core.remote_engine import is_remote
    if not attachments or is_remote(engine):   # a server counts its own tokens (and trims or refuses)
        return
    kept = [m for m in messages[:-1] if m["role"] == "system"] + [messages[-1]]
    n = len(engine.prompt_ids(kept, chat=chat))
    budget = prompt_budget(engine.n_ctx, reserve)
    if n >= budget:
        files = ", ".join(f"{a.name}: {count_tokens(engine, a)}" for a in attachments)
        raise BadInputError(f"the message with its attachments is {n} tokens ({files}) but the context holds "
                            f"{engine.n_ctx}{_kept_free(engine.n_ctx, budget)}; attach less or raise --ctx")


def _kept_free(n_ctx: int, budget: int) -> str:
    return f" (with {n_ctx - budget} kept free for the reply)" if budget < n_ctx else ""
