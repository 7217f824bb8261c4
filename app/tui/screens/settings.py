"""Sampling settings of the current chat: a field for each single-valued SamplingParams option
(app/args.py). Values are checked with SamplingParams.validate: a bad value is refused in place,
with the reason, and nothing is saved."""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from app.args import SETTINGS_OPTIONS, label, sampling_from_text
from core.types import SamplingParams
from models.errors import BadInputError


class SettingsScreen(ModalScreen[SamplingParams | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, params: SamplingParams):
        super().__init__()
        self.params = params

    def compose(self):
        with Vertical(classes="dialog settings"):
            yield Label("Sampling settings (this chat)", classes="dialog-title")
            for f in SETTINGS_OPTIONS:
                value = getattr(self.params, f.name)
                with Horizontal(classes="field"):
                    yield Label(label(f), classes="field-label")
                    yield Input("" if value is None else str(value), id=f"set-{f.name}")
            yield Label("", id="settings-error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel (esc)", id="cancel")

    def read(self) -> SamplingParams:
        """The values typed, validated; raises BadInputError with a one-line reason."""
        texts = {f.name: self.query_one(f"#set-{f.name}", Input).value for f in SETTINGS_OPTIONS}
        return sampling_from_text(texts, self.params)

    def action_save(self) -> None:
        error = self.query_one("#settings-error", Label)
        try:
            params = self.read()
        except BadInputError as e:
            error.update(f"✗ {e}")
            error.add_class("-shown")
            return
        self.dismiss(params)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)
