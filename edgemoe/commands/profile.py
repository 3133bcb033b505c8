"""`edgemoe profile`: store a routing profile in a store."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgemoe import options
from edgemoe.errors import EdgeMoEError

from .cannot_act import refuse_options_that_cannot_act
from .common import read_text, refuse_overwrite
from .options import checked, force_option, quiet_option, threads_option

@refuse_options_that_cannot_act
def profile(
    store: Path = typer.Argument(..., help="Store directory."),
    text: Optional[Path] = typer.Option(None, "--text", help="Calibration text to run through the store."),
    trace_file: Optional[Path] = typer.Option(None, "--trace", help="Or: build the profile from this trace."),
    context: Optional[int] = typer.Option(None, callback=checked(options.integer_at_least, 2),
                                          help="Window length in tokens."),
    min_count: int = typer.Option(3, "--min-count", callback=checked(options.integer_at_least, 1),
                                  help="Back off from a correlation key seen fewer times."),
    threads: Optional[int] = threads_option(),
    quiet: bool = quiet_option(),
    force: bool = force_option("profile.json (convert --calib writes one)"),
):
    """Store the routing profile (popularity, correlation table) used for placement and preload."""
    from edgemoe.store import read_manifest
    from edgemoe.store.format import PROFILE
    from edgemoe.loader import is_store
    from edgemoe.tracing import profile_store
    from edgemoe.progress import progress_bar

    if (text is None) == (trace_file is None):
        raise EdgeMoEError("profile: give --text or --trace (exactly one)")
    if not is_store(store):
        raise EdgeMoEError(f"{store}: not a store; a routing profile belongs to a store (make one with "
                           f"edgemoe convert, which profiles it when given --calib)")
    refuse_overwrite(store / PROFILE, [text, trace_file], force)
    spec = read_manifest(store).spec
    options.window_length(context, "--context", spec.max_position_embeddings)
    content = read_text(text) if text else None
    with progress_bar("profiling routing", quiet) as report:
        result = profile_store(store, content, trace_file, context, min_count, threads, report)
    print(f"profiled {store}: {sum(result.counts[result.moe_layers[0]]) // result.top_k} tokens, "
          f"{sum(len(t) for t in result.given_prev2.values())} correlation keys; saved to {store / PROFILE}")
