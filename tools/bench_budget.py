#!/usr/bin/env python
"""Adaptive (per-expert width) stores against uniform ones, on calibration and held-out text.

    python tools/bench_budget.py [MODEL_DIR] --out-dir /tmp/budget [--budgets 1% 2% 5% 10%]
                                 [--importance local exact] [--search-minutes 10 0.02] [--no-uniform] [--json]

For each budget and importance method, `edgemoe convert --budget` (the search on the calibration
text, the store written, the loss confirmed on the held-out text); for each uniform width, a uniform
store evaluated on both texts with the same metric. Defaults: the bundled model, its calib.txt and
eval.txt, metric ppl, local importance, the default time target (--search-minutes: each value a
run of its own; 0: no target, every window).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import edgemoe
from edgemoe.bundled import BUNDLED_DIR
from edgemoe.convert import QualityBudget
from edgemoe.convert.budget import IMPORTANCE_METHODS, metric_loss, parse_budget
from edgemoe.convert.pipeline import SEARCH_MINUTES
from edgemoe.evaluate import evaluate
from edgemoe.store import inspect_store
from edgemoe.convert import convert


def store_row(store: Path, name: str, calib_loss: float, heldout_loss: float, seconds: float) -> dict:
    summary = inspect_store(store)
    counts = {}
    for row in summary["widths"].values():
        for b in row:
            counts[b] = counts.get(b, 0) + 1
    return {"store": name, "expert_bytes": summary["expert_bytes"], "bits_per_weight": summary["bits_per_weight"],
            "widths": counts, "calib_loss": calib_loss, "heldout_loss": heldout_loss, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path, default=BUNDLED_DIR)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--calib", type=Path, default=BUNDLED_DIR / "calib.txt")
    parser.add_argument("--heldout", type=Path, default=BUNDLED_DIR / "eval.txt")
    parser.add_argument("--budgets", nargs="+", default=["1%", "2%", "5%", "10%"])
    parser.add_argument("--metric", default="ppl")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--importance", nargs="+", default=["local"], choices=IMPORTANCE_METHODS)
    parser.add_argument("--search-minutes", nargs="+", type=float, default=[SEARCH_MINUTES])
    parser.add_argument("--no-uniform", action="store_true", help="Only the budget stores.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    calib, heldout = args.calib.read_text(), args.heldout.read_text()
    reference = edgemoe.load(args.model)
    rows = []
    for bits in () if args.no_uniform else (2, 4, 8):
        start = time.perf_counter()
        out = args.out_dir / f"uniform-int{bits}"
        convert(args.model, out, bits=bits, force=True)
        model = edgemoe.load(out, preload="none")
        losses = [metric_loss(evaluate(model, reference.tokenizer.encode(text, add_special_tokens=False),
                                       context=args.context, stride=args.context, reference=reference), args.metric)
                  for text in (calib, heldout)]
        rows.append(store_row(out, f"uniform INT{bits}", *losses, time.perf_counter() - start))
    for method, minutes, budget in itertools.product(args.importance, args.search_minutes, args.budgets):
        start = time.perf_counter()
        out = args.out_dir / f"budget-{budget.rstrip('%')}-{method}-{minutes:g}min"
        quality = QualityBudget(parse_budget(budget), args.metric, heldout_text=heldout, context=args.context,
                                importance=method, search_minutes=minutes or None)
        done = convert(args.model, out, budget=quality, calib_text=calib, force=True)
        row = store_row(out, f"{budget} {method} {minutes:g}m", done.search.loss, done.heldout_loss,
                        time.perf_counter() - start)
        rows.append({**row, "budget": parse_budget(budget), "importance": method, "search_minutes": minutes,
                     "windows": done.sample and [done.sample.windows, done.sample.of],
                     "calib_bound": done.search.loss_bound, "search_seconds": done.search.seconds,
                     "evaluations": done.search.evaluations})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'store':20} {'expert KiB':>10} {'bits/w':>7} {'INT2/4/8':>10} {'calib loss':>10} {'held-out':>9} {'s':>6}")
    for r in rows:
        w = "/".join(str(r["widths"].get(b, 0)) for b in (2, 4, 8))
        print(f"{r['store']:20} {r['expert_bytes'] / 1024:10.1f} {r['bits_per_weight']:7.3f} {w:>10} "
              f"{r['calib_loss']:10.4f} {r['heldout_loss']:9.4f} {r['seconds']:6.1f}")


if __name__ == "__main__":
    main()
