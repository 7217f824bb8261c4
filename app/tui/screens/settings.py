"""Sampling settings of the current chat. Values are checked with SamplingParams.validate: a bad
value is refused in place, with the reason, and nothing is saved."""
from __future__ import annotations

import dataclasses

from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from core.types import SamplingParams
from models.errors import BadInputError

FIELDS = [  # (field, label, type)
    ("temperature", "temperature (0 = greedy)", float),
    ("top_k", "top-k (0 = off)", int),
    ("top_p", "top-p (1 = off)", float),
    ("min_p", "min-p (0 = off)", float),
    ("repeat_penalty", "repeat penalty (1 = off)", float),
    ("max_tokens", "max tokens", int),
    ("seed", "seed (empty = random)", int),
]


def params_from_dict(values: dict) -> SamplingParams:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in values.items() if k in known})


def params_to_dict(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name, _, _ in FIELDS}


class SettingsScreen(ModalScreen[SamplingParams | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, params: SamplingParams):
        super().__init__()
        self.params = params

    def compose(self):
        with Vertical(classes="dialog settings"):
            yield Label("Sampling settings (this chat)", classes="dialog-title")
            for name, label, _ in FIELDS:
                value = getattr(self.params, name)
                with Horizontal(classes="field"):
                    yield Label(label, classes="field-label")
                    yield Input("" if value is None else str(value), id=f"set-{name}")
            yield Label("", id="settings-error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel (esc)", id="cancel")

    def read(self) -> SamplingParams:
        """The values typed, validated; raises BadInputError with a one-line reason."""
        values = {}
        for name, label, kind in FIELDS:
            raw = self.query_one(f"#set-{name}", Input).value.strip()
            if name == "seed" and raw == "":
                values[name] = None
                continue
            try:
                values[name] = kind(raw)
            except ValueError:
                raise BadInputError(f"{label.split(' (')[0]}: '{raw}' is not a{'n integer' if kind is int else ' number'}") from None
        return dataclasses.replace(self.params, **values).validate()

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
