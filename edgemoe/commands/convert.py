"""`edgemoe convert`: quantize a checkpoint's experts into a tiered store."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from edgemoe import options
from edgemoe.errors import EdgeMoEError
from edgemoe.progress import staged_progress

from .common import bundled_text_for, read_text, size
from .options import QUIET, THREADS, checked, force_option

METRICS = ("ppl", "top1", "kl")
IMPORTANCE_METHODS = ("local", "exact")       # edgemoe.convert.budget's, without importing torch here
SEARCH_MINUTES = 10.0                         # edgemoe.convert.pipeline's, likewise


def _confidence(value: float, flag: str) -> float:
    if not 0.5 <= value < 1:
        raise options.OptionError(flag, value, "expected a number in [0.5, 1)")
    return value


def convert(
    model: Path = typer.Argument(..., help="Hugging Face checkpoint directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Store directory to create."),
    bits: int = typer.Option(4, "--bits", callback=checked(options.one_of, (2, 4, 8)),
                             help="Width of every expert: 2, 4 or 8."),
    widths: Optional[Path] = typer.Option(None, "--widths", help='Per-expert widths, JSON {"widths": '
                                          '{"<layer>": [bits, ...]}}, overriding --bits.'),
    group_size: Optional[int] = typer.Option(None, "--group-size", callback=checked(options.integer_at_least, 1),
                                             help="Quantization group along the input dimension (default: one "
                                             "group per row)."),
    method: str = typer.Option("rtn", "--method", callback=checked(options.one_of, ("rtn", "hqq")),
                               help="rtn (round to nearest) or hqq (refined zero points)."),
    compress: Optional[str] = typer.Option(None, "--compress", callback=checked(options.one_of, ("zstd",)),
                                           help="zstd: compress each expert blob."),
    fallback_bits: Optional[int] = typer.Option(None, "--fallback-bits", callback=checked(options.one_of, (2, 4)),
                                                help="Also store each wider expert narrowed to 2 or 4 bits: the copy "
                                                "read for a weakly chosen miss (run --fallback-below)."),
    force: bool = force_option("store (only a store)"),
    workers: Optional[int] = typer.Option(None, "--workers", callback=checked(options.integer_at_least, 1),
                                          help="Quantization threads (default: as --threads)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text: profile the store's routing "
                                         "on it, and search widths on it with --budget (default for the "
                                         "bundled model: its calib.txt)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Quality loss allowed, e.g. 5%: per-expert "
                                         "widths from 2/4/8, the store as small as possible within it."),
    metric: str = typer.Option("ppl", "--metric", callback=checked(options.one_of, METRICS),
                               help="Loss for --budget: ppl (relative perplexity increase), top1 (1 - top-1 "
                               "agreement) or kl (mean KL, nats/token)."),
    heldout: Optional[Path] = typer.Option(None, "--heldout", help="Held-out text to confirm the budget on "
                                           "(default for the bundled model: its eval.txt)."),
    calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", callback=checked(options.integer_at_least, 2),
                                               help="Use at most this many calibration tokens for --budget."),
    search_minutes: float = typer.Option(SEARCH_MINUTES, "--search-minutes", callback=checked(options.finite_at_least),
                                         help="--budget's time target: where the search's projected time on "
                                         "this machine exceeds it, it runs on fewer calibration windows, evenly "
                                         "spread (16 at least); 0: all windows, however long."),
    confidence: float = typer.Option(0.95, "--confidence", callback=checked(_confidence),
                                     help="--budget must hold for this one-sided upper confidence bound of the "
                                     "calibration loss, in [0.5, 1) (0.5: the estimate)."),
    importance: str = typer.Option("local", "--importance", callback=checked(options.one_of, IMPORTANCE_METHODS),
                                   help="How --budget ranks experts: local (each expert's output error on its "
                                   "tokens, scaled per layer; one re-run per layer) or exact (one re-run per "
                                   "expert)."),
    profile_tokens: Optional[int] = typer.Option(None, "--profile-tokens",
                                                 callback=checked(options.integer_at_least, 1),
                                                 help="Trace at most this many tokens of --calib for the "
                                                 "routing profile (default 4096, docs/budget.md)."),
    allow_no_tokenizer: bool = typer.Option(False, "--allow-no-tokenizer", help="Convert a checkpoint without "
                                            "tokenizer.json: a store for token ids only (bench, the Python API); "
                                            "run, eval and chat refuse it (default: refused here)."),
    threads: Optional[int] = THREADS,
    quiet: bool = QUIET,
):
    """Quantize a checkpoint's experts into a tiered store (and profile its routing on --calib)."""
    from edgemoe.convert import QualityBudget, check_destination, convert as convert_store
    from edgemoe.convert.budget import parse_budget
    from edgemoe.convert.pipeline import PROFILE_TOKENS
    from edgemoe.threads import set_command_threads

    calib = calib or bundled_text_for(model, "calib.txt")
    if budget is not None:
        if widths is not None:
            raise EdgeMoEError("--budget chooses the widths: give it or --widths, not both")
        if calib is None:
            raise EdgeMoEError("--budget needs calibration text: --calib FILE (the bundled model uses its calib.txt)")
        heldout = heldout or bundled_text_for(model, "eval.txt")
    if profile_tokens is not None and calib is None:
        raise EdgeMoEError("--profile-tokens: only with --calib (it caps the calibration text's tokens profiled)")
    inputs = [p for p in (widths, calib, heldout) if p is not None]
    check_destination(out, force, [model, *inputs])
    calib_text = read_text(calib) if calib is not None else None      # every input read before any work
    quality = None if budget is None else QualityBudget(
        _budget(parse_budget(budget), budget, metric), metric, confidence, calib_tokens,
        read_text(heldout) if heldout else None, importance=importance, search_minutes=search_minutes or None)
    workers = workers or set_command_threads(threads)
    with staged_progress(quiet) as report:
        result = convert_store(model, out, bits=bits, widths=widths, group_size=group_size, method=method,
                               compress=compress, force=force, workers=workers, budget=quality,
                               calib_text=calib_text, threads=threads, progress=report, inputs=inputs,
                               fallback_bits=fallback_bits, allow_no_tokenizer=allow_no_tokenizer,
                               profile_tokens=profile_tokens or PROFILE_TOKENS,
                               notice=None if quiet else lambda message: print(message, file=sys.stderr))
    widths_text = ", ".join(f"INT{b}: {n}" for b, n in result.widths.items())
    print(f"wrote {result.store}: {result.experts} experts ({widths_text}), expert bytes "
          f"{size(result.expert_bytes)} ({result.bits_per_weight:.3f} bits/weight), dense "
          f"{size(result.dense_bytes)}; {result.seconds:.1f} s in all, peak RSS {size(result.peak_rss_bytes)}")
    if result.fallback_copies:
        print(f"fallback copies: {result.fallback_copies} experts at INT{fallback_bits}, "
              f"{size(result.fallback_bytes)}")
    if result.profiled:
        print(f"profiled routing on {calib}")
    if result.search is not None:
        _print_budget(result, metric)


def _print_budget(result, metric: str) -> None:
    from edgemoe.convert.pipeline import sample_message

    s = result.search
    if result.sample is not None and result.sample.windows < result.sample.of:
        print(sample_message(result.sample))
    uniform = ", ".join(f"INT{b} {v:+.4f}" for b, v in s.uniform_loss.items())
    print(f"budget {metric} <= {s.budget:.4f}: calibration loss {s.loss:.4f} (bound {s.loss_bound:.4f})"
          + (f", held-out loss {result.heldout_loss:.4f}" if result.heldout_loss is not None else "")
          + f" (uniform: {uniform}; floor INT{s.floor}, ceiling INT{s.ceiling}, {s.moved_down} experts at the floor, "
          f"ranked by {s.importance_method} importance)")
    if not s.feasible:
        print("warning: even INT8 everywhere exceeds the budget on the calibration text; wrote all INT8")


def _budget(limit: float, text: str, metric: str) -> float:
    """--budget (`text`, parsed as `limit`) as a fraction; ppl and top1 losses are shares (at most
    100%), kl is in nats."""
    if limit <= 0 or (metric != "kl" and limit > 1):
        expected = "a loss above 0" if metric == "kl" else "a loss in (0%, 100%]"
        raise options.OptionError("--budget", text, f"expected {expected} for --metric {metric} (a budget that "
                                  f"allows every expert at INT2 is --bits 2)")
    return limit
