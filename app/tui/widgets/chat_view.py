"""The conversation's messages, mounted in a scrolling view.

Only the newest SHOWN_MESSAGES are mounted; older ones stay in the history behind an "earlier
messages" line. Every layout pass of a streaming reply walks all mounted widgets (a Markdown reply
is one widget per block), so many mounted messages slow decoding in the chat to a crawl (README:
measured)."""
from __future__ import annotations

from textual.containers import VerticalScroll

from app.tui.widgets.messages import AssistantMessage, EarlierMessages, MessageBox, UserMessage, code_blocks

SHOWN_MESSAGES = 30


class ChatView(VerticalScroll):

    @staticmethod
    def message_widget(m) -> MessageBox:
        if m.role == "user":
            return UserMessage(m.content, m.id)
        note = m.timings.get("error", "") if m.status == "error" else ""
        return AssistantMessage(m.content, m.id, m.status, model=m.model, note=note)

    async def show(self, messages: list, show_all: bool = False) -> None:
        """Replace the view with a conversation's messages (history rows)."""
        await self.remove_children()
        if messages:
            hidden = 0 if show_all else max(0, len(messages) - SHOWN_MESSAGES)
            widgets: list = [EarlierMessages(hidden)] if hidden else []
            widgets += [self.message_widget(m) for m in messages[hidden:]]
            await self.mount_all(widgets)
            self.anchor()

    @property
    def has_earlier(self) -> bool:
        return bool(self.query(EarlierMessages))

    async def add(self, box: MessageBox) -> None:
        """Mount a new message at the end, unmounting the oldest once well over SHOWN_MESSAGES."""
        await self.mount(box)
        boxes = list(self.query(MessageBox))
        if len(boxes) > SHOWN_MESSAGES + 10:
            drop = boxes[:len(boxes) - SHOWN_MESSAGES]
            notices = list(self.query(EarlierMessages))
            hidden = (notices[0].n_hidden if notices else 0) + len(drop)
            await self.remove_children(drop + notices)
            await self.mount(EarlierMessages(hidden), before=0)
        self.anchor()

    async def remove_from(self, message_id: int | None, only: bool = False) -> None:
        """Unmount the message message_id and (unless only) every later one."""
        if message_id is None:
            return
        for box in list(self.query(MessageBox)):
            if box.message_id is not None and (box.message_id == message_id or
                                               (not only and box.message_id > message_id)):
                await box.remove()

    def target_reply(self) -> AssistantMessage | None:
        """The focused reply, else the last one: what the copy keys copy."""
        focused = self.app.focused
        if isinstance(focused, AssistantMessage):
            return focused
        replies = list(self.query(AssistantMessage))
        return replies[-1] if replies else None

    def copy_text(self, code: bool) -> tuple[str | None, str]:
        """(text to copy or None, what to tell the user) for the target reply or its last code block."""
        reply = self.target_reply()
        if not code:
            if reply is None or not reply.content:
                return None, "No reply to copy"
            return reply.content, f"Copied the reply ({len(reply.content)} characters)"
        blocks = code_blocks(reply.content) if reply is not None else []
        if not blocks:
            return None, "No code block in the reply"
        return blocks[-1], f"Copied the code block ({len(blocks[-1].splitlines())} lines)"
