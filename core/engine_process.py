"""An Engine in a child process, for the TUI.

Why: the engine's Python glue (between numba kernels) and Textual's rendering share one GIL when
they share a process. With a long chat on screen, every streamed update costs Textual tens of
milliseconds of Python, and the engine waits for all of it (README: measured). In its own process
the engine never waits for the UI.

`EngineProcess` has the part of Engine's surface the TUI uses: model_name, backend_name, n_ctx,
has_chat_template, device, notes, prompt_ids, count_tokens, generate, close, and a `backend` view with
the backend's capabilities, stats, timings, finish_reason, kv_block_map() and set_decode_threads().

Protocol (pickled messages over a socket pair; the Engine's arguments first, then one request at a
time under a lock):
  parent -> child   ("prompt_ids", messages, chat) | ("count_tokens", text) | ("set_decode_threads", n)
                    | ("generate", ids, params, spec) | ("cancel",) (during a generation) | ("close",)
  child -> parent   ("progress", stage, done, total)   while loading (and loading a draft model)
                    ("ready", info) | ("failed", bad_input, message)        once, after loading
                    ("ok", value) | ("error", bad_input, message)           a request's answer
                    ("token", TokenEvent) | ("stats", Snapshot)           while generating
                    ("end", Snapshot)                                      a generation's last message
The child's reader thread sets its cancel flag the moment ("cancel",) arrives, so it takes effect
mid-prefill (at the next chunk). The child exits when the socket closes (the app quit or was
killed), and ignores SIGINT (the terminal's Ctrl-C is the app's).
"""
from __future__ import annotations

import dataclasses
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Iterator, Sequence

from core.backend import Capabilities, Described
from core.types import LiveStats, SamplingParams, SpeculativeConfig, Timings, TokenEvent
from models.errors import BadInputError

STATS_EVERY_S = 0.1     # the child sends live counters this often while it generates
POLL_S = 0.05           # how often the parent looks at the app's cancel flag while it waits
CHILD_MAIN = "from core.engine_process import main; main()"  # (not -m: its classes must pickle by module name)
LOG_NAME = "engine.log"  # the child's stderr (numba and library warnings must not draw over the TUI)


@dataclass(frozen=True)
class Snapshot:
    """What the TUI reads of a backend, as of one moment in the child."""
    stats: LiveStats
    timings: Timings
    finish_reason: str | None
    kv_block_map: list[str]


def _snapshot(backend) -> Snapshot:
    stats = dataclasses.replace(backend.stats, token_latencies_ms=list(backend.stats.token_latencies_ms))
    return Snapshot(stats, dataclasses.replace(backend.timings), backend.finish_reason, list(backend.kv_block_map()))


# --- the child ------------------------------------------------------------------------------
def main() -> None:
    """The child's entry point (`python -c CHILD_MAIN FD`): FD is its end of a socket pair.
    A reader thread takes the parent's messages: ("cancel",) sets the cancel flag at once (mid-
    generation), everything else queues for the main thread. The pipe closing (the app quit or was
    killed) cancels whatever runs and ends the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    kwargs = conn.recv()
    cancel = threading.Event()
    requests: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                cancel.set()
                requests.put(None)
                return
            if msg[0] == "cancel":
                cancel.set()
            else:
                requests.put(msg)

    threading.Thread(target=read, daemon=True).start()
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    def progress(stage: str, done: int, total: int) -> None:
        send(("progress", stage, done, total))

    from core.engine import Engine             # (importing core set numba's compile cache)
    try:
        engine = Engine(**kwargs, progress=progress, backend_progress=progress)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        send(("failed", isinstance(e, BadInputError), str(e) or type(e).__name__))
        return
    backend = engine.backend
    send(("ready", {"model_name": engine.model_name, "backend_name": engine.backend_name, "n_ctx": engine.n_ctx,
                    "has_chat_template": engine.has_chat_template, "device": engine.device, "notes": engine.notes,
                    "capabilities": backend.capabilities,
                    "snapshot": _snapshot(backend)}))
    try:
        while (request := requests.get()) is not None:
            kind = request[0]
            if kind == "close":
                return
            try:
                if kind == "prompt_ids":
                    send(("ok", engine.prompt_ids(request[1], chat=request[2])))
                elif kind == "count_tokens":
                    send(("ok", engine.count_tokens(request[1])))
                elif kind == "set_decode_threads":
                    backend.set_decode_threads(request[1])
                    send(("ok", None))
                elif kind == "generate":
                    cancel.clear()
                    _generate(engine, backend, request[1], request[2], request[3], cancel, send)
                else:
                    send(("error", False, f"unknown request {kind!r}"))
            except OSError:      # the parent is gone
                return
            except Exception as e:  # noqa: BLE001 - the parent raises it; the child keeps serving
                send(("error", isinstance(e, BadInputError), str(e) or type(e).__name__))
    finally:
        engine.close()


def _generate(engine, backend, ids, params, spec, cancel, send) -> None:
    """Stream one generation's tokens, with live counters every STATS_EVERY_S from a side thread
    (prefill sends no tokens for seconds; the X-ray still moves)."""
    running = threading.Event()
    running.set()

    def report() -> None:
        while running.is_set():
            time.sleep(STATS_EVERY_S)
            if running.is_set():
                try:
                    send(("stats", _snapshot(backend)))
                except (OSError, EOFError):
                    return

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        for event in engine.generate(ids, params, cancel, spec):
            send(("token", event))
    finally:
        running.clear()
        reporter.join()
    send(("end", _snapshot(backend)))


# --- the parent -----------------------------------------------------------------------------
class BackendView(Described):
    """The backend as the TUI sees it: its capabilities, and the child's last snapshot, refreshed
    as it generates."""

    def __init__(self, owner: "EngineProcess", info: dict):
        self._owner = owner
        self.capabilities: Capabilities = info["capabilities"]
        self.snapshot: Snapshot = info["snapshot"]
        self._decode_threads: int | None = None

    @property
    def stats(self) -> LiveStats:
        return self.snapshot.stats

    @property
    def timings(self) -> Timings:
        return self.snapshot.timings

    @property
    def finish_reason(self) -> str | None:
        return self.snapshot.finish_reason

    def kv_block_map(self) -> list[str]:
        return self.snapshot.kv_block_map

    def set_decode_threads(self, n: int | None) -> None:
        if not self.capabilities.decode_threads:
            raise NotImplementedError(f"the {self.name} backend has no separate decode threads")
        if n != self._decode_threads:
            self._owner._request(("set_decode_threads", n))
            self._decode_threads = n


class EngineProcess:
    """core.engine.Engine's arguments; the model loads in a child process (progress callbacks run
    in the calling thread, as the child reports). Raises what Engine would: BadInputError for a bad
    model or option, RuntimeError if the child dies."""

    def __init__(self, model: str | None = None, backend: str | None = None, n_ctx: int | None = None,
                 threads: int | None = None, progress=None, backend_progress=None, device: str = "auto",
                 kv_disk: bool | None = None, kv_disk_max: int | None = None):
        from core.engine import DEFAULT_CTX
        from core.paths import cache_dir
        from models import registry
        kwargs = {"model": model or registry.DEFAULT_MODEL, "backend": backend,
                  "n_ctx": n_ctx or DEFAULT_CTX, "threads": threads, "device": device,
                  "kv_disk": kv_disk, "kv_disk_max": kv_disk_max}
        self.log_path = cache_dir() / LOG_NAME
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[1])
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "w") as log:
            # a plain subprocess (not multiprocessing): nothing of the caller's __main__ is re-run
            self._process = subprocess.Popen([sys.executable, "-c", CHILD_MAIN, str(theirs.fileno())],
                                             pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=log, env=env)   # cwd kept: a relative -m path
        theirs.close()              # the parent keeps one end: the child sees EOF when the parent goes
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._progress = progress or backend_progress
        self._conn.send(kwargs)
        msg = self._recv_until(("ready", "failed"))
        if msg[0] == "failed":
            self._process.wait(5)
            raise BadInputError(msg[2]) if msg[1] else RuntimeError(msg[2])
        info = msg[1]
        self.model_name: str = info["model_name"]
        self.backend_name: str = info["backend_name"]
        self.n_ctx: int = info["n_ctx"]
        self.has_chat_template: bool = info["has_chat_template"]
        self.device: str = info["device"]
        self.notes: list[str] = info["notes"]
        self.backend = BackendView(self, info)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _stopped(self) -> RuntimeError:
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        return RuntimeError(f"the engine process stopped (exit code {self._process.returncode}); see {self.log_path}")

    def _send(self, msg) -> None:
        try:
            self._conn.send(msg)
        except OSError:
            raise self._stopped() from None

    def _recv(self):
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            raise self._stopped() from None
        if msg[0] == "progress" and self._progress is not None:
            self._progress(*msg[1:])
        return msg

    def _recv_until(self, kinds: tuple[str, ...]):
        while True:
            msg = self._recv()
            if msg[0] in kinds:
                return msg

    def _request(self, request):
        with self._lock:
            self._send(request)
            msg = self._recv_until(("ok", "error"))
        if msg[0] == "error":
            raise BadInputError(msg[2]) if msg[1] else RuntimeError(msg[2])
        return msg[1]

    def prompt_ids(self, messages, chat: bool = True) -> list[int]:
        if not isinstance(messages, str):
            messages = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        return self._request(("prompt_ids", messages, chat))

    def count_tokens(self, text: str) -> int:
        """Engine.count_tokens in the child. Like every request it waits for a generation to end."""
        return self._request(("count_tokens", text))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None,
                 speculative: SpeculativeConfig | None = None) -> Iterator[TokenEvent]:
        """Engine.generate, streamed from the child. Stopping early (break, or an exception in the
        caller) cancels the child's generation and drains it, so the pipe is clean for the next request."""
        with self._lock:
            self._send(("generate", list(prompt_ids), params, speculative))
            finished = cancelled = False
            try:
                while True:
                    if cancel is not None and cancel.is_set() and not cancelled:
                        self._send(("cancel",))
                        cancelled = True
                    if not self._conn.poll(POLL_S):
                        continue
                    msg = self._recv()
                    kind = msg[0]
                    if kind == "token":
                        yield msg[1]
                    elif kind in ("stats", "end"):
                        self.backend.snapshot = msg[1]
                        if kind == "end":
                            finished = True
                            return
                    elif kind == "error":
                        finished = True
                        raise BadInputError(msg[2]) if msg[1] else RuntimeError(msg[2])
            finally:
                if not finished and self._process.poll() is None:
                    try:
                        self._conn.send(("cancel",))
                        while (msg := self._recv())[0] not in ("end", "error"):
                            pass
                        if msg[0] == "end":
                            self.backend.snapshot = msg[1]
                    except (RuntimeError, OSError):
                        pass

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                with self._lock:
                    self._conn.send(("close",))
            except OSError:
                pass
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)
        self._conn.close()
