"""Progress bars (rich) for long operations a person waits on in the CLI: savepoint export,
restoring a savepoint's state. Library code takes a plain callback (``Progress``); only the
CLI turns it into a bar.

Threads: the caller's (rich refreshes the bar from its own thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

#: ``callback(what, done, total)``: ``done`` of ``total`` units of the step ``what``.
ProgressCallback = Callable[[str, int, int], None]


@contextmanager
def progress_bar(console: Console, unit: str = "tasks") -> Iterator[ProgressCallback]:
    """A callback that drives one bar per step ``what`` (text after " (" is a detail that
    updates the bar's description, e.g. rows and bytes so far); every bar is completed on
    exit."""
    bars: dict[str, tuple[TaskID, int]] = {}
    with Progress(
        TextColumn("  {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:

        def update(what: str, done: int, total: int) -> None:
            # "state (1,234 rows, 5.0 MB)": one bar per step, its details in the description.
            step = what.split(" (", 1)[0]
            if step not in bars:
                bars[step] = (progress.add_task(what, total=max(total, 1)), total)
            task_id, _ = bars[step]
            progress.update(task_id, completed=done, total=max(total, 1), description=what)
            bars[step] = (task_id, total)

        try:
            yield update
        finally:
            for task_id, total in bars.values():
                progress.update(task_id, completed=max(total, 1))
