"""The attach prompt (ctrl+f): a file's path, completed from its directory's entries as it is typed."""
from __future__ import annotations

import os
from pathlib import Path

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widgets import Input, Label


def complete_path(value: str) -> str | None:
    """`value` completed with the entries of its directory that start its last part: the longest
    start they share, or the first of them when they share no more than what is typed (as fish
    suggests). A directory gets its '/', so the next part completes on. Hidden entries only for a
    part that starts with '.'."""
    head, sep, prefix = value.rpartition("/")
    folder = Path(head + sep or ".").expanduser()
    try:
        names = sorted(entry.name for entry in os.scandir(folder)
                       if entry.name.startswith(prefix) and (prefix.startswith(".") or not entry.name.startswith(".")))
    except OSError:        # not a directory, or not readable: nothing to suggest
        return None
    if not names:
        return None
    common = os.path.commonprefix(names)
    name = common if len(common) > len(prefix) else names[0]
    if name in names and (folder / name).is_dir():
        name += "/"
    return value + name[len(prefix):]


class PathSuggester(Suggester):
    def __init__(self):
        super().__init__(use_cache=False, case_sensitive=True)    # directories change; names are case-sensitive

    async def get_suggestion(self, value: str) -> str | None:
        return complete_path(value)


class AttachScreen(ModalScreen[str | None]):
    """Returns the path (None: cancelled). Enter on a directory opens it for completion instead."""
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("tab", "complete", "Complete", show=False)]

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Attach a text file to the next message", classes="dialog-title")
            yield Input(placeholder="path/to/file.txt", id="attach-path", suggester=PathSuggester())
            yield Label("tab or → completes · enter attaches · esc cancels", classes="hint")

    def action_complete(self) -> None:
        self.query_one(Input).action_cursor_right()    # at the end of the text, it takes the suggestion

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if not value:
            return
        if Path(value).expanduser().is_dir():
            event.input.value = value if value.endswith("/") else value + "/"
            event.input.action_end()
            return
        self.dismiss(value)
