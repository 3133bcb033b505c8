#!/usr/bin/env python
"""One pass of the budget search's quantized twin over calibration windows, in its variants, timed
side by side in one process: what every evaluation of `convert --budget` costs.

    python tools/bench_search_pass.py MODEL_DIR [--text FILE] [--tokens 4096] [--bits 4] [--rounds 2] [--json]

Variants (BudgetSearch's batch_tokens and gemm_dtype):
    one-window-float32   a window a layer call, experts dequantized to float32 (the search before)
    batched-float32      windows batched up to BATCH_TOKENS tokens a call, float32 experts
    batched-default      batched, experts in the store's "dequant" GEMM type on this machine (the default)
Each pass evaluates every window with every expert at --bits (a uniform store, as the search's first
evaluations do); the rounds alternate the variants, and the first pass of each (dequantizing and
compiling) is not timed. Prints seconds per pass (median over rounds), the default's speed-up over
the first variant, and how far each variant's loss is from the first's (rounding of batched and
bfloat16 products). MODEL_DIR: a checkpoint directory (tools/slice_layers.py cuts a large one to a
few layers). The text defaults to the bundled calib.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import edgemoe
from edgemoe.bundled import BUNDLED_DIR
from edgemoe.convert.budget import BATCH_TOKENS, BudgetSearch, Calibration

VARIANTS = {
    "one-window-float32": dict(batch_tokens=0, gemm_dtype=torch.float32),
    "batched-float32": dict(batch_tokens=BATCH_TOKENS, gemm_dtype=torch.float32),
    "batched-default": dict(batch_tokens=BATCH_TOKENS, gemm_dtype=None),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--text", default=str(BUNDLED_DIR / "calib.txt"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--metric", default="top1")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = edgemoe.load(args.model, threads=args.threads)
    with open(args.text, encoding="utf-8") as f:
        ids = torch.tensor(model.tokenizer.encode(f.read(), add_special_tokens=False))[:args.tokens]
    calibration = Calibration(model, ids, args.context, args.metric)
    searches = {name: BudgetSearch(model, calibration, **options) for name, options in VARIANTS.items()}
    seconds = {name: [] for name in VARIANTS}
    losses = {}
    for round_ in range(args.rounds + 1):
        for name, search in searches.items():
            widths = {key: args.bits for key in search.keys}
            search._window_losses.clear()      # every round computes the pass anew
            start = time.perf_counter()
            losses[name] = search.loss(widths)[0]
            if round_:
                seconds[name].append(time.perf_counter() - start)
    for search in searches.values():
        search.close()
    first = next(iter(VARIANTS))
    result = {
        "model": args.model, "tokens": calibration.tokens + len(calibration.windows), "bits": args.bits,
        "metric": args.metric, "gemm_dtype": str(searches["batched-default"].experts.gemm_dtype),
        "seconds_per_pass": {name: statistics.median(s) for name, s in seconds.items()},
        "rounds": seconds, "loss": losses,
    }
    result["speedup"] = {name: result["seconds_per_pass"][first] / s for name, s in result["seconds_per_pass"].items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.model}: {result['tokens']} tokens, INT{args.bits}, default GEMM type {result['gemm_dtype']}")
    for name in VARIANTS:
        print(f"  {name:20s} {result['seconds_per_pass'][name]:7.2f} s a pass  x{result['speedup'][name]:.2f}"
              f"  loss {losses[name]:.6f} ({losses[name] - losses[first]:+.2e})")


if __name__ == "__main__":
    main()
