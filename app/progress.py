"""Progress bars on stderr for pulls, verification and compiles (rich, which textual brings along)."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn


@contextlib.contextmanager
def stderr_progress() -> Iterator:
    """Yields a callback (stage, done, total). Bytes totals (>1 MB) are shown as sizes."""
    console = Console(file=sys.stderr)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[amount]}"),
                   TimeRemainingColumn(),
                   console=console, transient=False)
    tasks: dict[str, TaskID] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            if not bar.live.is_started:
                bar.start()
            for other in tasks.values():   # a new stage finishes the previous one
                bar.update(other, completed=bar.tasks[other].total)
            tasks[stage] = bar.add_task(stage, total=total, amount="")
        amount = f"{done / 1e6:.0f}/{total / 1e6:.0f} MB" if total > 1_000_000 else f"{done}/{total}"
        bar.update(tasks[stage], completed=done, total=total, amount=amount)

    try:
        yield update
    finally:
        if bar.live.is_started:
            bar.stop()
