#!/usr/bin/env python
"""The budget search's two importance estimates side by side: Spearman rank correlation of the
local estimate with the exact one, and the seconds each takes.

    python tools/bench_importance.py [--model DIR] [--arch mixtral qwen3_moe ...] [--json]

--model (default the bundled model): its calibration text (calib.txt, or --calib), metric ppl.
--arch: tiny random checkpoints of these architectures (tools/make_tiny_model.py, 8 experts where
the architecture takes the count, 3 layers), the bundled calib.txt's first --tiny-chars characters,
metric kl (a random model's perplexity barely moves under quantization). Both estimates rank on the
same windows (the search's ranking half) at floor --floor under ceiling --ceiling.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

import edgemoe
from edgemoe.bundled import BUNDLED_DIR
from edgemoe.convert.budget import BudgetSearch, Calibration

TOOLS = Path(__file__).resolve().parent
# Config overrides giving each tiny architecture 8 routed experts and 3 layers (the expert count's
# name differs by architecture; DeepSeek's tiny models already have a dense first layer).
TINY = {
    "mixtral": dict(num_local_experts=8, num_hidden_layers=3),
    "qwen2_moe": dict(num_experts=8, num_hidden_layers=3),
    "qwen3_moe": dict(num_experts=8, num_hidden_layers=3),
    "olmoe": dict(num_experts=8, num_hidden_layers=3),
    "deepseek_v3": dict(n_routed_experts=8),
    "phimoe": dict(num_local_experts=8, num_hidden_layers=3),
    "gpt_oss": dict(num_local_experts=8, num_hidden_layers=3),
    "switch_transformers": dict(num_experts=8),
}


def compare(model_dir: Path, text: str, metric: str, floor: int, ceiling: int, context: int) -> dict:
    model = edgemoe.load(model_dir, torch.float32)
    ids = torch.tensor(model.tokenizer.encode(text, add_special_tokens=False))
    calibration = Calibration(model, ids, min(context, model.context_length), metric)
    ranking, _ = calibration.halves()
    scores, seconds = {}, {}
    for method in ("exact", "local"):
        search = BudgetSearch(model, calibration, importance=method)
        start = time.perf_counter()
        scores[method] = search.importance(floor, ceiling, ranking)
        seconds[method] = time.perf_counter() - start
    keys = sorted(scores["exact"])
    rho = spearmanr([scores["exact"][k] for k in keys], [scores["local"][k] for k in keys]).statistic
    return {"experts": len(keys), "tokens": calibration.tokens, "metric": metric, "spearman": float(rho),
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BUNDLED_DIR)
    parser.add_argument("--calib", type=Path, default=BUNDLED_DIR / "calib.txt")
    parser.add_argument("--arch", nargs="*", default=[], choices=sorted(TINY))
    parser.add_argument("--tiny-chars", type=int, default=6000)
    parser.add_argument("--floor", type=int, default=2)
    parser.add_argument("--ceiling", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--skip-model", action="store_true", help="Only the tiny architectures.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    text = args.calib.read_text()
    rows = {}
    if not args.skip_model:
        rows[args.model.name] = compare(args.model, text, "ppl", args.floor, args.ceiling, args.context)
    spec = importlib.util.spec_from_file_location("make_tiny_model", TOOLS / "make_tiny_model.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            directory = make_tiny.make_tiny_model(Path(tmp) / arch, arch, **TINY[arch])
            rows[f"tiny {arch}"] = compare(directory, text[:args.tiny_chars], "kl", args.floor, args.ceiling,
                                           args.context)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'model':24} {'experts':>7} {'tokens':>7} {'metric':>6} {'spearman':>8} {'exact s':>8} {'local s':>8}")
    for name, r in rows.items():
        print(f"{name:24} {r['experts']:7d} {r['tokens']:7d} {r['metric']:>6} {r['spearman']:8.3f} "
              f"{r['seconds']['exact']:8.1f} {r['seconds']['local']:8.1f}")


if __name__ == "__main__":
    main()
