"""One box per message in the chat view. Assistant replies are Markdown, streamed in batches."""
from __future__ import annotations

import re

from textual.containers import Vertical
from textual.widgets import Markdown, Static

CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of a Markdown text (an unclosed last fence counts: it is still streaming)."""
    return [m.group(1).rstrip("\n") for m in CODE_BLOCK.finditer(text)]


class MessageBox(Vertical, can_focus=True):
    """A message; focus it (click or tab) to make it the target of the copy keys."""
    role = ""

    def __init__(self, content: str, message_id: int | None = None, status: str = "complete", **kwargs):
        super().__init__(**kwargs)
        self.content = content
        self.message_id = message_id
        self.status = status
        self.add_class(f"-{self.role}")


class UserMessage(MessageBox):
    role = "user"

    def compose(self):
        self.border_title = "You"
        yield Static(self.content, markup=False, classes="body")


class AssistantMessage(MessageBox):
    role = "assistant"

    def __init__(self, content: str = "", message_id: int | None = None, status: str = "complete",
                 model: str = "", note: str = "", **kwargs):
        super().__init__(content, message_id, status, **kwargs)
        self.model = model
        self.note = note
        self._stream = None

    def compose(self):
        self.border_title = self.model or "assistant"
        yield Markdown(self.content)

    def on_mount(self) -> None:
        self._show_status()

    def _show_status(self) -> None:
        labels = {"streaming": "…", "stopped": "stopped", "interrupted": "interrupted", "error": "error"}
        parts = [labels.get(self.status, ""), self.note]
        self.border_subtitle = " · ".join(p for p in parts if p)
        self.set_class(self.status in ("stopped", "interrupted", "error"), "-incomplete")

    async def append(self, fragment: str) -> None:
        """Add streamed text; MarkdownStream coalesces fragments that arrive faster than it renders."""
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self.content += fragment
        await self._stream.write(fragment)

    async def finish(self, status: str, note: str = "") -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.status, self.note = status, note
        await self.query_one(Markdown).update(self.content or ("*(no text)*" if status == "complete" else ""))
        self._show_status()


class EarlierMessages(Static, can_focus=True):
    """Stands in for the older messages of a long chat, which are not mounted (every layout pass
    of a streaming reply walks all mounted widgets). Click it, or press f6, to show them."""

    def __init__(self, n_hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.n_hidden = n_hidden

    def render(self) -> str:
        noun = "message" if self.n_hidden == 1 else "messages"
        return f"▲ {self.n_hidden} earlier {noun} · f6 or click to show"

    def on_click(self) -> None:
        self.app.run_action("show_earlier")
