"""`edgemoe eval`: perplexity over a text; with --reference, agreement and KL too."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

import json

from edgemoe import options
from edgemoe.bundled import bundled_text
from edgemoe.errors import EdgeMoEError
from edgemoe.progress import progress_bar

from .common import read_text, warn_ram_auto
from .options import (COMPUTE, DENSE_BITS, DEVICE, DTYPE, FALLBACK_BELOW, JSON, KV_DTYPE, MODEL, POLICY, PRELOAD,
                      QUIET, RAM, SKIP_BELOW, THREADS, VRAM, as_store_options, checked, model_path, torch_dtype)


def eval_(
    model: Optional[Path] = MODEL,
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text file (default with the bundled "
                                        "model: its held-out eval.txt)."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Also report top-1 agreement and KL "
                                             "divergence against this model."),
    context: Optional[int] = typer.Option(None, callback=checked(options.integer_at_least, 2),
                                          help="Window length in tokens (default: the model's "
                                          "max_position_embeddings, at most 1024)."),
    stride: Optional[int] = typer.Option(None, callback=checked(options.integer_at_least, 1),
                                         help="Window step (default: context / 2)."),
    decode: bool = typer.Option(False, "--decode", help="Score token by token through the KV cache, as "
                                "generation runs (slower; for options that act per step: --ram; implied by "
                                "--skip-below and --fallback-below)."),
    as_json: bool = JSON,
    ram: Optional[str] = RAM,
    vram: Optional[str] = VRAM,
    device: Optional[str] = DEVICE,
    policy: str = POLICY,
    preload: str = PRELOAD,
    skip_below: float = SKIP_BELOW,
    fallback_below: float = FALLBACK_BELOW,
    compute: str = COMPUTE,
    dtype: str = DTYPE,
    dense_bits: str = DENSE_BITS,
    kv_dtype: str = KV_DTYPE,
    threads: Optional[int] = THREADS,
    quiet: bool = QUIET,
):
    """Perplexity over a text (sliding window); with --reference, agreement and KL too."""
    import edgemoe
    from edgemoe.evaluate import DEFAULT_CONTEXT, evaluate_text
    from edgemoe.loader import require_decoder_only

    store_options = as_store_options(ram=ram, vram=vram, device=device, policy=policy, preload=preload,
                                     skip_below=skip_below, fallback_below=fallback_below, compute=compute)
    if text is None:
        if model is not None:
            raise EdgeMoEError("--text is required for a model other than the bundled one")
        text = bundled_text("eval.txt")
    content = read_text(text)

    # Skipping and fallback copies act on misses every token of a step chose weakly: a whole window's
    # tokens choose nearly every expert strongly at least once, so only token by token (as generation
    # runs) measures what they do.
    decode = decode or bool(skip_below or fallback_below)
    path = model_path(model)
    m = edgemoe.load(path, torch_dtype(dtype), threads, store=store_options, dense_bits=dense_bits, kv_dtype=kv_dtype,
                     context=context or DEFAULT_CONTEXT, score_windows=not decode)
    warn_ram_auto(m)
    require_decoder_only(m.spec, path, "edgemoe eval (next-token perplexity)")
    options.window_length(context, "--context", m.context_length)
    if stride is not None and stride > (context or m.context_length):
        raise options.OptionError("--stride", stride, "expected at most the window length (--context)")
    ref = edgemoe.load(reference, torch_dtype(dtype), threads) if reference is not None else None
    with progress_bar("evaluating windows", quiet) as report:
        result = evaluate_text(m, content, context=context, stride=stride, reference=ref, on_progress=report,
                               decode=decode)
    tiered_store = getattr(m.experts, "store", None)
    reads = {} if tiered_store is None else {
        "disk_bytes_per_token": tiered_store.stats.disk_bytes_read / m.timings.tokens,
        "skipped_per_token": m.experts.skipped / m.timings.tokens,
        "fallback_uses_per_token": m.experts.fallback_uses / m.timings.tokens}
    if as_json:
        print(json.dumps({**result.to_dict(), **reads}))
        return
    print(f"text: {text} ({result.tokens} tokens scored; context {result.context} tokens, stride {result.stride})")
    if reads:
        print(f"store: {reads['disk_bytes_per_token'] / 2**20:.3f} MiB read from disk per token run, "
              f"{reads['skipped_per_token']:.3f} expert choices skipped and "
              f"{reads['fallback_uses_per_token']:.3f} served by fallback copies per token")
    print(f"perplexity: {result.perplexity:.4f}   (nll {result.nll:.4f} nats/token)")
    if ref is not None:
        print(f"reference perplexity: {result.reference_perplexity:.4f}")
        print(f"top-1 agreement with reference: {result.top1_agreement:.4f}")
        print(f"mean KL(reference || model): {result.kl:.6f} nats/token")
