"""Small modal dialogs: yes/no confirmation and one-text prompts (rename, system prompt)."""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, TextArea


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("escape", "dismiss(False)", "Cancel"), Binding("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self.question, markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (esc)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class PromptScreen(ModalScreen[str | None]):
    """One line of text (rename) or several (system prompt: ctrl+s saves)."""
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, title: str, value: str = "", multiline: bool = False):
        super().__init__()
        self.title_text, self.value, self.multiline = title, value, multiline

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self.title_text, markup=False)
            if self.multiline:
                yield TextArea(self.value, id="prompt-value", soft_wrap=True)
                yield Label("ctrl+s saves · esc cancels", classes="hint")
            else:
                yield Input(self.value, id="prompt-value")
                yield Label("enter saves · esc cancels", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_save(self) -> None:
        widget = self.query_one("#prompt-value")
        self.dismiss(widget.text if isinstance(widget, TextArea) else widget.value)
