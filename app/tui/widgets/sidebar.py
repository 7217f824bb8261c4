"""The conversation list (toggled with ctrl+b)."""
from __future__ import annotations

from dataclasses import dataclass

from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, ListItem, ListView

from core.history import Conversation


class ConversationItem(ListItem):
    def __init__(self, conversation: Conversation):
        super().__init__(Label(f"#{conversation.id} {conversation.title}", markup=False))
        self.conversation = conversation


class Sidebar(Vertical):
    @dataclass
    class Selected(Message):
        conversation_id: int

    def compose(self):
        self.border_title = "Chats"
        yield ListView(id="conversations")

    async def show(self, conversations: list[Conversation], current: int | None) -> None:
        view = self.query_one(ListView)
        await view.clear()
        await view.extend([ConversationItem(c) for c in conversations])
        view.index = next((i for i, c in enumerate(conversations) if c.id == current), None)

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Selected(event.item.conversation.id))
