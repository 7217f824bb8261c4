"""The kvchat TUI: a chat view that streams from the engine, a conversation sidebar, live stats and
an Inference X-ray panel.

Processes: a model the app loads runs in a child process (core.engine_process.EngineProcess), so
the engine's Python never queues behind Textual's on the GIL; an Engine handed in runs in-process.
Threading: the engine is driven from a Textual thread worker. That thread never touches a widget; it
posts small dataclass Messages (app.tui.events) that the UI handles with @on. Token text is batched in the
worker (at most 10 posts a second) and MarkdownStream coalesces whatever still arrives faster than
it renders. What a message does to the conversation (send, edit, regenerate, trimming, the reply's
history) is core.chat_session's: this module renders the session and sends it intents.
"""
from __future__ import annotations

import os
import threading
import time

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer
from textual.worker import get_current_worker

from app.tui.actions import ChatActions
from app.tui.attach_actions import AttachmentActions
from app.tui.events import ModelFailed, ModelLoaded, ModelProgress, ResponseDone, ResponseFailed, ResponseStarted, TokenArrived
from app.tui.widgets.attachments import AttachmentBar
from app.tui.widgets.chat_input import ChatInput
from app.tui.widgets.chat_view import ChatView
from app.tui.widgets.messages import AssistantMessage, UserMessage
from app.tui.widgets.model_loading import ModelLoading
from app.tui.widgets.sidebar import Sidebar
from app.tui.widgets.stats import StatusBar, XRayPanel, speculative_text, status_line
from core.attachments import compose_message
from core.chat_session import ChatSession, DecodeThreads, Reply
from core.history import History
from core.types import SamplingParams
from core.remote_engine import UNKNOWN_CTX
from models.errors import BadInputError

__all__ = ["KvChatApp", "TokenArrived", "run_tui"]

TOKEN_BATCH_S = 0.1        # the worker posts streamed text at most 10 times a second (each post re-lays out the chat)
STATS_REFRESH_S = 0.25


class KvChatApp(ChatActions, AttachmentActions, App):
    CSS_PATH = "kvchat.tcss"
    TITLE = "kvchat"
    BINDINGS = [
        # the footer shows the first ones; at 80 columns everything up to Help must fit
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+r", "regenerate", "Regen"),
        Binding("f4", "settings", "Settings"),
        Binding("f5", "switch_model", "Model"),
        Binding("ctrl+t", "toggle_xray", "X-ray"),
        Binding("ctrl+b", "toggle_sidebar", "Chats"),
        Binding("question_mark,f1", "help", "Help"),
        Binding("ctrl+e", "edit_last", "Edit", show=False, priority=True),
        Binding("f2", "rename_chat", "Rename", show=False),
        Binding("f3", "system_prompt", "System prompt", show=False),
        Binding("f8", "delete_chat", "Delete chat", show=False),
        Binding("ctrl+g", "copy_reply", "Copy reply", show=False),
        Binding("ctrl+l", "copy_code", "Copy code", show=False),
        Binding("ctrl+o", "export_chat", "Export", show=False),
        Binding("ctrl+f", "attach", "Attach", show=False),
        Binding("f10", "toggle_theme", "Theme", show=False),
        Binding("f6", "show_earlier", "Earlier messages", show=False, priority=True),  # over TextArea's f6
    ]

    def __init__(self, model: str | None = None, backend: str | None = None, n_ctx: int | None = None,
                 threads: int | None = None, engine=None, db_path=None, speculative=None, device: str = "auto",
                 kv_disk: dict | None = None, remote: dict | None = None, output_format: dict | None = None):
        super().__init__()
        from core.engine import DEFAULT_CTX
        from models.registry import DEFAULT_MODEL
        self.model_spec = model or (engine.model_name if engine is not None else DEFAULT_MODEL)
        self.backend_pref, self.device_pref = backend, device
        self.kv_disk = kv_disk                     # Engine's kv_disk and kv_disk_max (app.args.kv_disk_from_args)
        self.remote = remote                       # backend openai: {base_url, api_key} (core.remote_engine)
        self.n_ctx = n_ctx or DEFAULT_CTX
        self.threads = threads
        self.decode_threads = DecodeThreads(os.cpu_count() or 1, os.environ.get("KVCHAT_DECODE_THREADS"))
        self.speculative = speculative             # core.types.SpeculativeConfig or None
        self.engine = engine
        self.owns_engine = False                   # an engine handed in belongs to the caller
        self.session = ChatSession(History(db_path))
        self.session.output_format = output_format or {}   # --json-schema / --grammar: every reply
        self.history = self.session.history
        self.generating = False
        self.generated_once = False                # live numbers appear after this app's first reply
        self.cancel_event = threading.Event()
        self.worker_idle = threading.Event()
        self.worker_idle.set()
        self.reply_widget: AssistantMessage | None = None
        self.loading_model: str | None = None
        self.queued_text: str | None = None        # sent once the model has loaded

    @property
    def conversation_id(self) -> int | None:
        return self.session.conversation_id

    @property
    def params(self) -> SamplingParams:
        return self.session.params

    @params.setter
    def params(self, params: SamplingParams) -> None:
        self.session.params = params

    # --- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield Sidebar(id="sidebar")
            with Vertical(id="chat"):
                yield ChatView(id="messages")
                yield ModelLoading(id="model-loading")
                yield AttachmentBar(id="attachments")
                yield ChatInput(id="input")
            yield XRayPanel(id="xray")
        yield StatusBar("", id="status", markup=False)
        yield Footer(compact=True, show_command_palette=False)  # ctrl+p still opens it

    async def on_mount(self) -> None:
        self.query_one(ChatView).anchor()
        self.stats_timer = self.set_interval(STATS_REFRESH_S, self.refresh_stats, pause=True)
        conversations = self.history.list_conversations()
        if conversations:
            await self.open_conversation(conversations[0].id)
        else:
            await self.refresh_sidebar()
        self.query_one(ChatInput).focus()
        if self.engine is None:
            self.loading_model = self.model_spec
            self.load_model(self.model_spec)
        self.refresh_stats()

    def on_unmount(self) -> None:
        self.cancel_event.set()
        if self.worker_idle.wait(5):   # let the reply be saved as 'stopped' before closing the db
            self.history.close()
        if self.owns_engine and self.engine is not None:
            self.engine.close()

    # --- conversations ---------------------------------------------------------------------
    async def refresh_sidebar(self) -> None:
        await self.query_one(Sidebar).show(self.history.list_conversations(), self.conversation_id)

    async def open_conversation(self, conversation_id: int | None, show_all: bool = False) -> None:
        messages = self.session.open(conversation_id)
        await self.query_one(ChatView).show(messages if conversation_id is not None else [], show_all)
        await self.refresh_sidebar()

    @on(Sidebar.Selected)
    async def on_sidebar_selected(self, event: Sidebar.Selected) -> None:
        if self.generating:
            self.notify("Generating: press esc to stop first", severity="warning")
            return
        if event.conversation_id != self.conversation_id:
            await self.open_conversation(event.conversation_id)
        self.query_one(ChatInput).focus()

    # --- sending and streaming -------------------------------------------------------------
    @on(ChatInput.Submitted)
    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> None:
        bar = self.query_one(AttachmentBar)
        attachments = bar.attachments
        if not text.strip() and not attachments:
            return
        if self.generating:
            self.notify("Still answering: press esc to stop it first", severity="warning")
            return
        if self.engine is None:
            if self.loading_model:
                self.queued_text = text
                self.notify("The model is still loading: the message is queued and sends when it is ready")
            else:
                self.notify("No model loaded: pick one with f5", severity="warning")
            return
        message = compose_message(text, attachments)
        if not self.attachments_fit(message, attachments):
            return                                    # the text and the chips stay, to be changed
        view = self.query_one(ChatView)
        title = text if text.strip() else ", ".join(a.name for a in attachments)
        message_id, dropped = self.session.send(message, self.engine.model_name, title)
        await view.remove_from(dropped)               # an edit: the old message and what followed go
        self.query_one(ChatInput).clear()
        await bar.clear()
        await view.add(UserMessage(message, message_id))
        await self.start_reply()
        await self.refresh_sidebar()

    async def start_reply(self) -> None:
        engine = self.engine
        try:
            reply = self.session.begin_reply(engine)
        except BadInputError as e:
            self.notify(str(e), severity="error")
            return
        except RuntimeError as e:   # the engine's process is gone (killed, out of memory)
            self.notify(f"{e}. Load a model again with f5.", title="Engine error", severity="error", timeout=10)
            return
        if reply.truncated:
            self.notify("The oldest turns no longer fit the context: this reply does not see them")
        self.reply_widget = AssistantMessage("", reply.id, "streaming", model=engine.model_name)
        await self.query_one(ChatView).add(self.reply_widget)
        self.generating = True
        self.generated_once = True
        self.cancel_event = threading.Event()
        self.worker_idle.clear()
        self.stats_timer.resume()
        self.refresh_stats(queued=True)
        self.generate_reply(engine, reply, self.cancel_event)

    @work(thread=True, exclusive=True, group="generate")
    def generate_reply(self, engine, reply: Reply, cancel: threading.Event) -> None:
        """The session streams the reply; this posts its text to the UI in batches."""
        worker = get_current_worker()
        pending: list[str] = []
        last_post = [time.monotonic()]

        def on_text(text: str) -> None:
            if worker.is_cancelled:
                cancel.set()
            pending.append(text)
            if time.monotonic() - last_post[0] >= TOKEN_BATCH_S:
                self.post_message(TokenArrived(reply.id, "".join(pending)))
                pending.clear()
                last_post[0] = time.monotonic()

        try:
            self.post_message(ResponseStarted(reply.id))
            backend = engine.backend
            threads = (self.decode_threads.next()
                       if self.threads is None and backend.capabilities.decode_threads else None)
            try:
                if threads:
                    backend.set_decode_threads(threads)
            except RuntimeError:
                pass                  # the engine is gone: generating reports it as the reply's error
            spec = self.speculative if backend.capabilities.speculative else None
            end = self.session.stream_reply(engine, reply, cancel, spec, on_text)
            if threads and end.status == "complete":
                self.decode_threads.record(threads, backend.timings.predicted_n, backend.timings.predicted_per_second)
            if pending:
                self.post_message(TokenArrived(reply.id, "".join(pending)))
            if end.status == "error":
                self.post_message(ResponseFailed(reply.id, end.summary))
            else:
                self.post_message(ResponseDone(reply.id, end.status, end.finish_reason, end.summary))
        finally:
            self.worker_idle.set()

    @on(ResponseStarted)
    def on_response_started(self, event: ResponseStarted) -> None:
        self.refresh_stats()

    @on(TokenArrived)
    async def on_token_arrived(self, event: TokenArrived) -> None:
        widget = self.reply_widget
        if widget is not None and widget.message_id == event.reply_id:
            await widget.append(event.text)

    @on(ResponseDone)
    async def on_response_done(self, event: ResponseDone) -> None:
        await self.end_reply(event.reply_id, event.status, event.summary)

    @on(ResponseFailed)
    async def on_response_failed(self, event: ResponseFailed) -> None:
        self.notify(f"Generation failed: {event.error}", severity="error", timeout=8)
        await self.end_reply(event.reply_id, "error", event.error)

    async def end_reply(self, reply_id: int, status: str, note: str) -> None:
        widget = self.reply_widget
        if widget is not None and widget.message_id == reply_id:
            await widget.finish(status, note)
        self.generating = False
        self.stats_timer.pause()
        self.refresh_stats()
        await self.refresh_sidebar()

    # --- stats -----------------------------------------------------------------------------
    def refresh_stats(self, queued: bool = False) -> None:
        engine, status, xray = self.engine, self.query_one(StatusBar), self.query_one(XRayPanel)
        xray.border_subtitle = f"{engine.backend_name} on {engine.device}" if engine is not None else ""
        if engine is None:
            status.show_no_engine(self.model_spec, bool(self.loading_model), self.queued_text is not None)
            xray.show(None, None)
        elif not self.generated_once:   # nothing measured in this session yet
            ctx = "n/a" if engine.n_ctx >= UNKNOWN_CTX else engine.n_ctx
            status.update(f"{engine.model_name} · {engine.backend_name} on {engine.device} · ctx {ctx} · ready")
        else:
            backend = engine.backend
            status.update(status_line(engine.model_name, f"{engine.backend_name} on {engine.device}", backend.stats,
                                      backend.timings, self.generating) + (" | queued" if queued else ""))
            if xray.display:
                xray.show(backend.stats, backend.kv_block_map(), queued, speculative_text(self.speculative, backend),
                          backend.where)

    # --- models ----------------------------------------------------------------------------
    def load_model(self, spec: str) -> None:
        # the backend the user named, else auto again: the next file may run where this one did not
        self.query_one(ModelLoading).load(spec, self.backend_pref, self.n_ctx, self.threads, self.device_pref,
                                          self.kv_disk, self.remote)

    @on(ModelProgress)
    def on_model_progress(self, event: ModelProgress) -> None:
        self.query_one(ModelLoading).show_progress(event)
        self.refresh_stats()

    @on(ModelLoaded)
    def on_model_loaded(self, event: ModelLoaded) -> None:
        old, self.engine = self.engine, event.engine
        self.loading_model = None
        self.model_spec = self.engine.model_name
        self.query_one("#model-loading").display = False
        if old is not None and old is not self.engine and self.owns_engine:
            old.close()                          # (an engine handed in belongs to the caller)
        self.owns_engine = True
        self.decode_threads.rates.clear()        # another model: measured again
        if not self.engine.has_chat_template:
            self.notify(f"{self.engine.model_name} has no chat template: plain completion of the conversation")
        for line in self.engine.notes:           # e.g. llama.cpp runs a file kvchat's engine does not
            self.notify(line, severity="warning")
        self.notify(f"Model {self.engine.model_name} ready ({self.engine.backend_name})")
        self.generated_once = False
        self.refresh_stats()
        if self.queued_text is not None:
            text, self.queued_text = self.queued_text, None
            self.call_later(self.send, text)

    @on(ModelFailed)
    def on_model_failed(self, event: ModelFailed) -> None:
        self.loading_model = None
        self.query_one("#model-loading").display = False
        keep = f"; keeping {self.engine.model_name}" if self.engine is not None else ""
        self.notify(f"Could not load {event.spec}: {event.error}{keep}", title="Model error", severity="error",
                    timeout=10)
        self.refresh_stats()

    # --- actions ---------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating:
            self.cancel_event.set()
            self.refresh_stats()
        elif self.session.cancel_edit():
            self.query_one(ChatInput).clear()
            self.notify("Edit cancelled")

    async def action_regenerate(self) -> None:
        if self.generating or self.engine is None or self.conversation_id is None:
            return
        await self.query_one(ChatView).remove_from(self.session.drop_last_reply(), only=True)
        await self.start_reply()


def run_tui(args) -> int:
    """`kvchat chat`: the App opens at once; the model loads in the background with a progress bar."""
    from app.args import FORMAT_OPTIONS, kv_disk_from_args, sampling_from_args
    from core.types import SpeculativeConfig
    speculative = SpeculativeConfig(args.speculative, args.draft_n, args.draft_model).validate()
    params = sampling_from_args(args, FORMAT_OPTIONS)   # (a bad schema or grammar: one line, before the app opens)
    output_format = {k: v for k, v in (("json_schema", params.json_schema), ("grammar", params.grammar)) if v}
    from app.cli import remote_args
    app = KvChatApp(model=args.model, backend=args.backend, n_ctx=args.ctx, threads=args.threads,
                    speculative=speculative, device=args.device, kv_disk=kv_disk_from_args(args),
                    remote=remote_args(args) or None, output_format=output_format)
    app.run()
    return 0
