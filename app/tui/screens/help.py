"""The help screen (? or f1): every key."""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# kvchat keys

| key | does |
|---|---|
| **enter** | send the message |
| **ctrl+j** (shift+enter, alt+enter where the terminal reports them) | newline in the message |
| **ctrl+f** | attach a text file to the next message: a path prompt (tab completes); a chip shows its tokens; click the chip, or tab onto it and press delete, to remove it |
| **esc** | stop the reply (kept, marked *stopped*); cancel an edit |
| **ctrl+r** | regenerate the last reply |
| **ctrl+e** | edit the last user message, then enter resends it |
| **ctrl+n** | new chat |
| **f2** | rename chat |
| **f8** | delete chat (asks first) |
| **f3** | system prompt of this chat |
| **f4** | sampling settings of this chat |
| **f5** | switch model (registry or a .gguf path) |
| **ctrl+t** | Inference X-ray panel |
| **ctrl+b** | conversation sidebar |
| **ctrl+g** | copy the focused (or last) reply |
| **ctrl+l** | copy the last code block of the focused (or last) reply |
| **ctrl+o** | export this chat (Markdown) to the data folder |
| **f6** | show the earlier messages of a long chat (the view keeps the last 30) |
| **f10** | dark / light theme |
| **tab** | move focus (click or tab onto a message to copy it) |
| **? / f1** | this help |
| **ctrl+p** | command palette |
| **ctrl+q** | quit |

The status bar shows, after each reply: TTFT, prompt eval rate, eval rate, context used N/max
and `cache_n` (prompt tokens reused from the KV cache). History is saved in SQLite as you go;
`kvchat export ID --format md|json` prints a chat.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "Close")]

    def compose(self):
        with VerticalScroll(classes="dialog help"):
            yield Markdown(HELP)
