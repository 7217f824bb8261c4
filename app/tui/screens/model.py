"""Pick a model: a registry entry or a local .gguf path."""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from models import registry


class ModelScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, current: str):
        super().__init__()
        self.current = current

    def compose(self):
        with Vertical(classes="dialog model"):
            yield Label("Switch model", classes="dialog-title")
            options = []
            for m in registry.REGISTRY.values():
                pulled = "downloaded" if registry.is_pulled(m.name) else f"pull {m.size / 1e6:.0f} MB"
                mark = "● " if m.name == self.current else "  "
                options.append(Option(f"{mark}{m.name}  ({pulled})", id=m.name))
            yield OptionList(*options, id="model-list")
            yield Label("or a local .gguf path (enter loads):")
            yield Input(placeholder="/path/to/model.gguf", id="model-path")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if value:
            self.dismiss(value)
