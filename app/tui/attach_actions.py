"""Attaching files to the message being written: a file is read and its tokens counted off the UI
thread, its chip appears once counted, and a message with files is checked against the context
before it is sent. A mixin of KvChatApp (app.tui.app), kept apart so that module holds the chat's
flow: send, stream, load. (Its handlers go by name, on_attachment_ready: Textual collects @on
handlers from the App's own class only.)"""
from __future__ import annotations

from textual import work

from app.tui.events import AttachmentReady, AttachmentRefused
from app.tui.widgets.attachments import AttachmentBar
from core.attachments import Attachment, check_attachment_fits, count_tokens, read_attachment
from models.errors import BadInputError


class AttachmentActions:
    def attachments_fit(self, message: str, attachments: list[Attachment]) -> bool:
        """A message with files is checked before it is saved: one that does not fit is a toast with
        its tokens and the context's size, and nothing typed or attached is lost."""
        if not attachments:
            return True
        try:
            self.session.check_fits(self.engine, message, attachments, self.params.max_tokens)
        except BadInputError as e:
            self.notify(str(e), title="Too long for the context", severity="error", timeout=10)
            return False
        except RuntimeError as e:   # the engine's process is gone
            self.notify(f"{e}. Load a model again with f5.", title="Engine error", severity="error", timeout=10)
            return False
        return True

    @work(thread=True, group="attach")
    def attach_file(self, engine, path: str, reserve: int) -> None:
        """Read a file and count its tokens off the UI thread: a big file takes seconds to tokenize,
        and the engine's process answers only after the reply in flight. Its chip appears once it is
        counted (AttachmentReady); a file that cannot be attached is a toast (AttachmentRefused)."""
        try:
            attachment = read_attachment(path)
            n_tokens = count_tokens(engine, attachment)
            check_attachment_fits(attachment, n_tokens, engine.n_ctx, reserve)
        except (BadInputError, RuntimeError) as e:    # RuntimeError: the engine's process is gone
            self.post_message(AttachmentRefused(str(e)))
            return
        self.post_message(AttachmentReady(attachment, n_tokens))

    async def on_attachment_ready(self, event: AttachmentReady) -> None:
        if not await self.query_one(AttachmentBar).add(event.attachment, event.n_tokens):
            self.notify(f"{event.attachment.name} is attached already")

    def on_attachment_refused(self, event: AttachmentRefused) -> None:
        self.notify(event.error, title="Cannot attach", severity="error", timeout=10)
