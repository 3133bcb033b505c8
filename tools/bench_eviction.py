#!/usr/bin/env python
"""Reads per token of every eviction policy, of adaptive eviction and of the store's default scheme,
on generated routing traces, at cache sizes from one token's working set to half the experts.

    python tools/bench_eviction.py --out DIR [--trace NAME ...] [--json]

For each trace (TRACES: Mixtral-like, and Qwen3-like fine-grained routing from nearly flat to skewed
popularity), writes DIR/NAME.jsonl (the scored text, token seed 0) and DIR/NAME-profile.jsonl
(another text of the same generated model, token seed 1: the profile never sees the scored tokens),
then simulates (edgemoe.scheduling.simulate, the store's own cache and policies):
- each of adaptive eviction's candidates alone (LRU, LFU, frequency-distance, expected-use), no
  preload, and adaptive eviction itself;
- the default scheme (DEFAULT_POLICY, correlation preload from the profile, the guard), as
  `edgemoe simulate` marks it "default";
- Belady's optimum (no preload).
Every row is reproducible with `edgemoe simulate DIR/NAME.jsonl --profile-from DIR/NAME-profile.jsonl
--cache-experts N [--tokens T] --json`.

Prints a Markdown table (or --json, the rows); DIR/results.jsonl keeps every row as it is made.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.policies import ADAPTIVE_CANDIDATES, DEFAULT_POLICY
from edgemoe.scheduling.profile import RoutingProfile, read_trace, tokens_from_trace, write_trace
from edgemoe.scheduling.synthetic_routing import RoutingTargets, generate

# name: (layers, experts, top-k, targets, sequences, tokens per sequence, cache sizes)
TRACES = {
    "mixtral": (32, 8, 2, RoutingTargets(), 8, 128, (64, 96, 128)),
    "qwen64-flat": (24, 64, 8, RoutingTargets(entropy=0.98), 4, 64, (192, 480, 768)),
    "qwen64-skewed": (24, 64, 8, RoutingTargets(entropy=0.85), 4, 64, (192, 480, 768)),
    "qwen128-flat": (48, 128, 8, RoutingTargets(entropy=0.98), 2, 32, (384, 1536)),
    "qwen128-skewed": (48, 128, 8, RoutingTargets(entropy=0.85), 2, 32, (384, 1536)),
}


def make_traces(name: str, out: Path) -> tuple[Path, Path, dict]:
    layers, experts, top_k, targets, sequences, tokens, _ = TRACES[name]
    scored, stats = generate(layers, experts, top_k, sequences, tokens, targets, seed=0)
    profiled, _ = generate(layers, experts, top_k, sequences, tokens, targets, seed=1)
    trace, profile = out / f"{name}.jsonl", out / f"{name}-profile.jsonl"
    write_trace(trace, scored)
    write_trace(profile, profiled)
    return trace, profile, stats.to_dict()


def bench_trace(name: str, out: Path) -> list[dict]:
    trace, profile_trace, stats = make_traces(name, out)
    layers, experts, top_k = TRACES[name][:3]
    records = read_trace(trace)
    profile = RoutingProfile.from_trace(read_trace(profile_trace), moe_layers=list(range(layers)),
                                        num_experts=experts, top_k=top_k)
    tokens = tokens_from_trace(records)
    rows = []
    for n in TRACES[name][-1]:
        start = time.perf_counter()
        adaptive, ghosts = on_demand(tokens, n, profile)
        default = sim.simulate(tokens, n, DEFAULT_POLICY, profile, None, profile, guard=True)
        belady = sim.simulate(tokens, n, "belady")
        per_token = {policy: misses / len(tokens) for policy, misses in ghosts.items()}
        best = min(per_token, key=per_token.get)
        rows.append({"trace": name, "cache_experts": n, "tokens": len(tokens), **per_token,
                     "best_fixed": best, "adaptive": adaptive["reads_per_token"],
                     "adaptive_changes": adaptive["adaptive_changes"],
                     "default_policy": DEFAULT_POLICY, "default": default["reads_per_token"],
                     "default_preloads_per_token": default["preloads_per_token"],
                     "belady": belady["reads_per_token"], "stats": stats,
                     "seconds": time.perf_counter() - start})
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
    return rows


def on_demand(tokens, capacity: int, profile) -> tuple[dict, dict[str, int]]:
    """Adaptive eviction without preload, and the misses of each of its candidates alone."""
    result = sim.simulate(tokens, capacity, "adaptive", prior=profile)
    alone = {name: sim.simulate(tokens, capacity, name, prior=profile) for name in ADAPTIVE_CANDIDATES}
    return result, {name: r["requests"] - r["hits"] for name, r in alone.items()}


def markdown(rows: list[dict]) -> str:
    lines = ["| trace | cache | LRU | LFU | freq.-distance | expected-use | adaptive | default | default vs best fixed "
             "| default vs LRU | Belady |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        best = r[r["best_fixed"]]
        lines.append(f"| {r['trace']} | {r['cache_experts']} | {r['lru']:.1f} | {r['lfu']:.1f} | "
                     f"{r['frequency-distance']:.1f} | {r['expected-use']:.1f} | {r['adaptive']:.1f} | "
                     f"{r['default']:.1f} | {100 * (r['default'] / best - 1):+.1f}% | "
                     f"{100 * (r['default'] / r['lru'] - 1):+.1f}% | {r['belady']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trace", action="append", choices=sorted(TRACES), help="default: all")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [row for name in (args.trace or TRACES) for row in bench_trace(name, args.out)]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
