"""`edgemoe trace`: record the routers' choices over a text."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgemoe import options
from edgemoe.progress import progress_bar
from edgemoe.scheduling.profile import write_trace

from .common import read_text, refuse_overwrite
from .options import QUIET, THREADS, checked, force_option


def trace(
    model: Path = typer.Argument(..., help="Store or checkpoint directory."),
    text: Path = typer.Option(..., "--text", help="UTF-8 text to run through the model."),
    out: Path = typer.Option(..., "--out", "-o", help="Trace file to write (JSON lines, docs/trace-format.md)."),
    context: Optional[int] = typer.Option(None, callback=checked(options.integer_at_least, 2),
                                          help="Window length in tokens (default: as edgemoe eval)."),
    threads: Optional[int] = THREADS,
    quiet: bool = QUIET,
    force: bool = force_option("trace file"),
):
    """Record the routers' choices over a text as a trace."""
    import edgemoe
    from edgemoe.loader import is_store
    from edgemoe.tracing import trace_text

    refuse_overwrite(out, [model, text], force)
    content = read_text(text)
    m = edgemoe.load(model, threads=threads, **({"preload": "none"} if is_store(model) else {}))
    options.window_length(context, "--context", m.context_length)
    with progress_bar("tracing", quiet) as report:
        records = trace_text(m, content, context, report)
    write_trace(out, records)
    print(f"wrote {out}: {len(records)} records ({len({(r.seq, r.token) for r in records})} tokens)")
