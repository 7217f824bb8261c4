"""The app's actions on the open conversation and the screen that do not touch a reply in flight:
the dialogs (rename, delete, system prompt, settings), copy and export, and the panels. A mixin of
KvChatApp (app.tui.app), kept apart so that module holds the chat's flow: send, stream, load."""
from __future__ import annotations

import dataclasses

from app.tui.screens.attach import AttachScreen
from app.tui.screens.dialogs import ConfirmScreen, PromptScreen
from app.tui.screens.help import HelpScreen
from app.tui.screens.model import ModelScreen
from app.tui.screens.settings import SettingsScreen
from app.tui.widgets.chat_input import ChatInput
from app.tui.widgets.chat_view import ChatView
from app.tui.widgets.sidebar import Sidebar
from app.tui.widgets.stats import XRayPanel, speculative_text
from core.types import SamplingParams


class ChatActions:
    def action_rename_chat(self) -> None:
        if self.conversation_id is None:
            self.notify("Nothing to rename yet: send a message first")
            return
        conv = self.history.get_conversation(self.conversation_id)

        async def renamed(title: str | None) -> None:
            if title and title.strip():
                self.session.rename(title)
                await self.refresh_sidebar()
        self.push_screen(PromptScreen("Rename chat", conv.title), renamed)

    def action_delete_chat(self) -> None:
        if self.conversation_id is None or self.generating:
            return
        conv = self.history.get_conversation(self.conversation_id)

        async def confirmed(yes: bool | None) -> None:
            if yes:
                await self.open_conversation(self.session.delete())
                self.notify(f"Deleted '{conv.title}'")
        self.push_screen(ConfirmScreen(f"Delete the chat '{conv.title}' and all its messages?"), confirmed)

    def action_system_prompt(self) -> None:
        current = self.session.system_prompt()

        def saved(text: str | None) -> None:
            if text is None:
                return
            self.session.set_system_prompt(text)
            self.notify("System prompt saved" + ("" if self.engine is None or self.engine.has_chat_template
                                                 else " (this model has no chat template: it is prepended as text)"))
        self.push_screen(PromptScreen("System prompt for this chat", current, multiline=True), saved)

    def action_attach(self) -> None:
        if self.engine is None:
            self.notify("Attach files once the model is loaded: it counts their tokens", severity="warning")
            return

        def chosen(path: str | None) -> None:
            if path:
                self.attach_file(self.engine, path, self.params.max_tokens)
        self.push_screen(AttachScreen(), chosen)

    def action_settings(self) -> None:
        def saved(params: SamplingParams | None) -> None:
            if params is None:
                return
            self.session.set_params(params)
            self.notify("Settings saved")
        self.push_screen(SettingsScreen(self.params), saved)

    def action_toggle_xray(self) -> None:
        xray = self.query_one(XRayPanel)
        xray.display = not xray.display
        if xray.display:
            if self.engine is not None and self.generated_once:
                xray.show(self.engine.backend.stats, self.engine.backend.kv_block_map(), False,
                          speculative_text(self.speculative, self.engine.backend), self.engine.backend.where)
            else:
                xray.show(None if self.engine is None else dataclasses.replace(self.engine.backend.stats,
                          phase="idle", token_latencies_ms=[], cache_n=0, n_past=0), None)

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        sidebar.display = not sidebar.display

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    def copy(self, code: bool) -> None:
        text, note = self.query_one(ChatView).copy_text(code)
        if text is not None:
            self.copy_to_clipboard(text)
        self.notify(note)

    def action_copy_reply(self) -> None:
        self.copy(code=False)

    def action_copy_code(self) -> None:
        self.copy(code=True)

    def action_export_chat(self) -> None:
        if self.conversation_id is None:
            self.notify("Nothing to export yet")
            return
        path = self.session.export(self.history.path.parent / "exports")
        self.notify(f"Exported to {path}", timeout=8)

    async def action_show_earlier(self) -> None:
        if self.conversation_id is None or not self.query_one(ChatView).has_earlier:
            return
        if self.generating:
            self.notify("Earlier messages show once the reply is done", severity="warning")
            return
        await self.open_conversation(self.conversation_id, show_all=True)

    def action_switch_model(self) -> None:
        if self.generating:
            self.notify("Stop the reply first (esc)", severity="warning")
            return

        def chosen(spec: str | None) -> None:
            if spec:
                self.loading_model = spec
                self.load_model(spec)
        self.push_screen(ModelScreen(self.engine.model_name if self.engine else self.model_spec), chosen)

    async def action_new_chat(self) -> None:
        if self.generating:
            self.notify("Stop the reply first (esc)", severity="warning")
            return
        await self.open_conversation(None)
        self.query_one(ChatInput).focus()

    def action_edit_last(self) -> None:
        if self.generating or self.conversation_id is None:
            return
        text = self.session.start_edit()
        if text is None:
            return
        box = self.query_one(ChatInput)
        box.text = text
        box.focus()
        self.notify("Editing your last message: enter resends it, esc cancels")
