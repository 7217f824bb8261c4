"""Loading a model in the background: a thread worker builds the engine and this bar shows its
progress. The engine runs in a child process (core.engine_process), so its Python never waits for
Textual's rendering on the GIL."""
from __future__ import annotations

import time

from textual import work
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from app.tui.events import ModelFailed, ModelLoaded, ModelProgress

PROGRESS_EVERY_S = 0.1


class ModelLoading(Horizontal):

    def compose(self):
        yield Label("", id="model-stage", markup=False)
        yield ProgressBar(id="model-progress", show_eta=False)

    def show_progress(self, event: ModelProgress) -> None:
        self.display = True
        self.query_one("#model-stage", Label).update(event.stage)
        self.query_one("#model-progress", ProgressBar).update(total=event.total or None, progress=event.done)

    @work(thread=True, exclusive=True, group="model")
    def load(self, spec: str, backend: str | None, n_ctx: int, threads: int | None, device: str = "auto",
             kv_disk: dict | None = None, remote: dict | None = None) -> None:
        """Posts ModelProgress while loading, then ModelLoaded or ModelFailed (they bubble to the app).
        remote ({base_url, api_key}, backend openai): a RemoteEngine in this process (it only waits
        on the network)."""
        from core.engine_process import EngineProcess
        last = [0.0]

        def progress(stage: str, done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or done >= total:
                last[0] = now
                self.post_message(ModelProgress(stage, done, total))

        self.post_message(ModelProgress(f"loading {spec}", 0, 0))
        try:
            if backend == "openai":
                from core.engine import open_engine
                engine = open_engine(spec, backend="openai", **(remote or {}))
            else:
                engine = EngineProcess(spec, backend=backend, n_ctx=n_ctx, threads=threads, progress=progress,
                                       backend_progress=progress, device=device, **(kv_disk or {}))
        except Exception as e:   # noqa: BLE001 - a bad file must not take the app down
            self.post_message(ModelFailed(spec, str(e) or type(e).__name__))
            return
        self.post_message(ModelLoaded(engine))
