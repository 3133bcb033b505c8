"""Progress bars for the commands' long steps: on stderr, and only where a person watches (stderr is
a terminal and --quiet was not given), so that piped output and logs stay clean."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

Report = Callable[[int, int], None]   # (done, total)


@contextmanager
def staged_progress(quiet: bool = False) -> Iterator[Callable[[str, int, int], None]]:
    """Bars for a command of several named stages; yields report(stage, done, total)."""
    if quiet or not sys.stderr.isatty():
        yield lambda stage, done, total: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as progress:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        yield report


@contextmanager
def progress_bar(description: str, quiet: bool = False) -> Iterator[Report]:
    """A bar for one step; yields report(done, total)."""
    with staged_progress(quiet) as report:
        yield lambda done, total: report(description, done, total)
