#!/usr/bin/env python
"""How many calibration tokens the routing profile needs (`convert --profile-tokens`): for each cap,
the profile built from the calibration text's first N tokens (edgemoe.tracing.trace_text, as convert
traces them), scored by the simulator (edgemoe.scheduling.simulate) on another text's trace: the
store's default scheme's reads per token and preload precision, against plain LRU without preloads.

    python tools/bench_profile_tokens.py --store STORE [--calib calib.txt] [--text eval.txt]
        [--caps 256 1024 4096 0] [--cache-fraction 0.25 0.5] [--json]
    python tools/bench_profile_tokens.py --synthetic 32 8 2 [--caps ...]     # layers experts top-k

--store: the store's own model traces both texts (default texts: the bundled model's calib.txt and
eval.txt; the first --scored tokens of the second are scored); "seconds" is the tracing time of the
cap. --synthetic: traces generated with a real Mixtral's routing statistics
(edgemoe.scheduling.synthetic_routing; profile and scored traces of one model seed, other token
seeds), sequences of 256 tokens. Cap 0 is the whole calibration text.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import edgemoe
from edgemoe.bundled import BUNDLED_DIR
from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.profile import RoutingProfile, tokens_from_trace
from edgemoe.scheduling.synthetic_routing import generate
from edgemoe.tracing import build_profile, trace_text

SEQUENCE = 256


def store_rows(args) -> tuple[list, dict]:
    """(scored tokens, cap -> (profile, seconds)) from the store's model on the two texts."""
    model = edgemoe.load(args.store, preload="none")
    calib, text = args.calib.read_text(), args.text.read_text()
    scored = tokens_from_trace(trace_text(model, text))[:args.scored]
    profiles = {}
    for cap in args.caps:
        start = time.perf_counter()
        records = trace_text(model, calib, max_tokens=cap or None)
        profiles[cap] = build_profile(model, records), time.perf_counter() - start
    model.close()
    return scored, profiles


def synthetic_rows(args) -> tuple[list, dict]:
    layers, experts, top_k = args.synthetic
    biggest = max(args.caps) or 16384
    records, _ = generate(layers, experts, top_k, math.ceil(biggest / SEQUENCE), SEQUENCE, seed=0)
    order = {key: i for i, key in enumerate(dict.fromkeys((r.seq, r.token) for r in records))}
    scored_records, _ = generate(layers, experts, top_k, math.ceil(args.scored / SEQUENCE), SEQUENCE, seed=1)
    scored = tokens_from_trace(scored_records)[:args.scored]
    profiles = {}
    for cap in args.caps:
        kept = [r for r in records if not cap or order[r.seq, r.token] < cap]
        profile = RoutingProfile.from_trace(kept, moe_layers=list(range(layers)), num_experts=experts, top_k=top_k)
        profiles[cap] = profile, None
    return scored, profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path)
    parser.add_argument("--synthetic", type=int, nargs=3, metavar=("LAYERS", "EXPERTS", "TOP_K"))
    parser.add_argument("--calib", type=Path, default=BUNDLED_DIR / "calib.txt")
    parser.add_argument("--text", type=Path, default=BUNDLED_DIR / "eval.txt")
    parser.add_argument("--caps", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 0])
    parser.add_argument("--scored", type=int, default=4096, help="tokens of the other text scored")
    parser.add_argument("--cache-fraction", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if (args.store is None) == (args.synthetic is None):
        parser.error("give --store or --synthetic")
    scored, profiles = store_rows(args) if args.store else synthetic_rows(args)
    experts = {(layer, e) for token in scored for layer, chosen in token.items() for e in chosen}
    total = len({layer for layer, _ in experts}) * (1 + max(e for _, e in experts))   # every layer alike
    rows = []
    for cap, (profile, seconds) in profiles.items():
        for fraction in args.cache_fraction:
            size = max(1, round(fraction * total))
            found = sim.run(scored, profile, [size], None, policies=("lru",))
            default = next(r for r in found if r["default"])
            plain = next(r for r in found if r["policy"] == "lru" and r["preload"] == "none" and not r["guard"])
            rows.append({"cap": cap, "cache_fraction": fraction, "cache_experts": size, "seconds": seconds,
                         "default_reads": default["reads_per_token"], "lru_reads": plain["reads_per_token"],
                         "preload_precision": default["preload_precision"]})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'cap':>6} {'cache':>6} {'trace s':>8} {'reads/token':>11} {'LRU reads':>9} {'precision':>9}")
    for r in rows:
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        precision = "-" if r["preload_precision"] is None else f"{r['preload_precision']:.3f}"
        print(f"{r['cap'] or 'all':>6} {r['cache_experts']:>6} {seconds:>8} {r['default_reads']:11.2f} "
              f"{r['lru_reads']:9.2f} {precision:>9}")


if __name__ == "__main__":
    main()
