"""`edgemoe profile`: store a routing profile in a store."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgemoe import options
from edgemoe.errors import EdgeMoEError
from edgemoe.progress import progress_bar

from .common import read_text, refuse_overwrite
from .options import QUIET, THREADS, checked, force_option


def profile(
    store_path: Path = typer.Argument(..., metavar="STORE", help="Store directory."),
    text: Optional[Path] = typer.Option(None, "--text", help="Calibration text to run through the store."),
    trace_file: Optional[Path] = typer.Option(None, "--trace", help="Or: build the profile from this trace."),
    context: Optional[int] = typer.Option(None, callback=checked(options.integer_at_least, 2),
                                          help="Window length in tokens."),
    min_count: int = typer.Option(3, "--min-count", callback=checked(options.integer_at_least, 1),
                                  help="Back off from a correlation key seen fewer times."),
    threads: Optional[int] = THREADS,
    quiet: bool = QUIET,
    force: bool = force_option("profile.json (convert --calib writes one)"),
):
    """Store the routing profile (popularity, correlation table) used for placement and preload."""
    from edgemoe.loader import is_store
    from edgemoe.store import read_manifest
    from edgemoe.store.format import PROFILE
    from edgemoe.tracing import profile_store

    if (text is None) == (trace_file is None):
        raise EdgeMoEError("profile: give --text or --trace (exactly one)")
    if not is_store(store_path):
        raise EdgeMoEError(f"{store_path}: not a store; a routing profile belongs to a store (make one with "
                           f"edgemoe convert, which profiles it when given --calib)")
    refuse_overwrite(store_path / PROFILE, [text, trace_file], force)
    spec = read_manifest(store_path).spec
    options.window_length(context, "--context", spec.max_position_embeddings)
    content = read_text(text) if text else None
    with progress_bar("profiling routing", quiet) as report:
        result = profile_store(store_path, content, trace_file, context, min_count, threads, report)
    print(f"profiled {store_path}: {sum(result.counts[result.moe_layers[0]]) // result.top_k} tokens, "
          f"{sum(len(t) for t in result.given_prev2.values())} correlation keys; saved to {store_path / PROFILE}")
