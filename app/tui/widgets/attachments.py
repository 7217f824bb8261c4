"""The files waiting to go with the next message: one chip each (name and token count) above the
input, until the message is sent. Click a chip, or tab onto it and press delete, to drop it."""
from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Static

from core.attachments import Attachment


class AttachmentChip(Static, can_focus=True):
    BINDINGS = [Binding("delete,backspace", "drop", "Remove")]

    @dataclass
    class Dropped(Message):
        chip: "AttachmentChip"

    def __init__(self, attachment: Attachment, n_tokens: int):
        super().__init__(f"{attachment.name} · {n_tokens} tokens ×", markup=False)
        self.attachment = attachment
        self.tooltip = "click (or delete) to remove it from the message"

    def on_click(self) -> None:
        self.action_drop()

    def action_drop(self) -> None:
        self.post_message(self.Dropped(self))


class AttachmentBar(Horizontal):
    """Hidden while nothing is attached. The chips are the list: what they hold is what is sent."""

    @property
    def attachments(self) -> list[Attachment]:
        return [chip.attachment for chip in self.query(AttachmentChip)]

    async def add(self, attachment: Attachment, n_tokens: int) -> bool:
        """Add a chip; False (nothing added) when the same file is attached already."""
        if any(a.path.resolve() == attachment.path.resolve() for a in self.attachments):
            return False
        await self.mount(AttachmentChip(attachment, n_tokens))
        self.display = True
        return True

    async def clear(self) -> None:
        await self.remove_children()
        self.display = False

    async def on_attachment_chip_dropped(self, event: AttachmentChip.Dropped) -> None:
        if event.chip.has_focus:
            self.screen.focus_next()     # the next chip, or after the last one the input
        await event.chip.remove()
        self.display = bool(self.attachments)
