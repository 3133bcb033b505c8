#!/usr/bin/env python
"""The budget search's two importance estimates side by side: Spearman rank correlation of the
local estimate with the exact one, and the seconds each takes.

    python tools/bench_importance.py [--model DIR] [--arch mixtral qwen3_moe ...] [--groups 0 2 1] [--json]

--model (default the bundled model): its calibration text (calib.txt, or --calib), metric ppl.
--arch: tiny random checkpoints of these architectures (tools/make_tiny_model.py, 8 experts where
the architecture takes the count, 3 layers), the bundled calib.txt's first --tiny-chars characters,
metric kl (a random model's perplexity barely moves under quantization). Both estimates rank on the
same windows (the search's ranking half) at floor --floor under ceiling --ceiling. --groups: the
local estimate with each of these numbers of sensitivity groups (BudgetSearch's sensitivity_groups:
one sensitivity per group of consecutive MoE layers; 0, or as many as the layers: one per layer),
a Spearman column each; --tiny-layers: the decoder-only tiny models' layer count.
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
SEQ2SEQ = ("switch_transformers",)
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


def compare(model_dir: Path, text: str, metric: str, floor: int, ceiling: int, context: int,
            groups: list[int]) -> dict:
    model = edgemoe.load(model_dir, torch.float32)
    ids = torch.tensor(model.tokenizer.encode(text, add_special_tokens=False))
    calibration = Calibration(model, ids, min(context, model.context_length), metric)
    ranking, _ = calibration.halves()
    scores, seconds = {}, {}
    for method, n in [("exact", 1), *(("local", n) for n in groups)]:
        name = "exact" if method == "exact" else f"local {n}"
        search = BudgetSearch(model, calibration, importance=method, sensitivity_groups=n or None)
        start = time.perf_counter()
        scores[name] = search.importance(floor, ceiling, ranking)
        seconds[name] = time.perf_counter() - start
    keys = sorted(scores["exact"])
    rho = {n: float(spearmanr([scores["exact"][k] for k in keys], [scores[f"local {n}"][k] for k in keys]).statistic)
           for n in groups}
    return {"experts": len(keys), "layers": len({l for l, _ in keys}), "tokens": calibration.tokens,
            "metric": metric, "spearman": rho, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BUNDLED_DIR)
    parser.add_argument("--calib", type=Path, default=BUNDLED_DIR / "calib.txt")
    parser.add_argument("--arch", nargs="*", default=[], choices=sorted(TINY))
    parser.add_argument("--tiny-chars", type=int, default=6000)
    parser.add_argument("--tiny-layers", type=int, help="Layers of the decoder-only tiny models (default: 3, "
                        "DeepSeek's its template's).")
    parser.add_argument("--groups", type=int, nargs="+", default=[0], help="0: one per layer (the default).")
    parser.add_argument("--floor", type=int, default=2)
    parser.add_argument("--ceiling", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--skip-model", action="store_true", help="Only the tiny architectures.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    text = args.calib.read_text()
    rows = {}
    if not args.skip_model:
        rows[args.model.name] = compare(args.model, text, "ppl", args.floor, args.ceiling, args.context, args.groups)
    spec = importlib.util.spec_from_file_location("make_tiny_model", TOOLS / "make_tiny_model.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            layers = {} if args.tiny_layers is None or arch in SEQ2SEQ else {"num_hidden_layers": args.tiny_layers}
            directory = make_tiny.make_tiny_model(Path(tmp) / arch, arch, **{**TINY[arch], **layers})
            rows[f"tiny {arch}"] = compare(directory, text[:args.tiny_chars], "kl", args.floor, args.ceiling,
                                           args.context, args.groups)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    columns = [f"rho g={n}" for n in args.groups] + ["exact s"] + [f"local s g={n}" for n in args.groups]
    print(f"{'model':24} {'layers':>6} {'experts':>7} {'tokens':>7} {'metric':>6} " + " ".join(f"{c:>12}" for c in columns))
    for name, r in rows.items():
        values = [f"{r['spearman'][n]:12.3f}" for n in args.groups] + [f"{r['seconds']['exact']:12.1f}"] + \
            [f"{r['seconds'][f'local {n}']:12.1f}" for n in args.groups]
        print(f"{name:24} {r['layers']:6d} {r['experts']:7d} {r['tokens']:7d} {r['metric']:>6} " + " ".join(values))


if __name__ == "__main__":
    main()
