#!/usr/bin/env python
"""What the eviction bookkeeping costs: process CPU time per layer call of the simulator (the store's
own cache and policies), LRU alone against adaptive eviction (its four ghost caches) and the store's
default scheme (SCHEMES), on generated traces (tools/bench_eviction.py's TRACES), at one token's working
set and at half the experts.

    python tools/bench_ghosts.py [--trace qwen64-flat ...] [--tokens 32] [--rounds 2]

Each (trace, size, scheme) is timed --rounds times, alternated, and the hits printed beside: a change
to how victims are found must leave them as they were.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.profile import RoutingProfile, tokens_from_trace
from edgemoe.scheduling.synthetic_routing import generate


# What is timed: LRU alone, adaptive eviction alone (its four ghost caches), and the store's default
# scheme (adaptive eviction, correlation preload from the profile, the guard: what `edgemoe simulate`
# marks "default").
SCHEMES = {
    "lru": lambda profile: {"policy": "lru"},
    "adaptive": lambda profile: {"policy": "adaptive"},
    "default": lambda profile: {"policy": sim.DEFAULT_POLICY, "preload_profile": profile, "guard": True},
}


def _eviction_tool():
    spec = importlib.util.spec_from_file_location("bench_eviction", Path(__file__).with_name("bench_eviction.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    traces = _eviction_tool().TRACES
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", action="append", choices=sorted(traces))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print("| trace | cache | policy | ms CPU per layer call (rounds) | hits |")
    print("|---|---:|---|---|---:|")
    for name in args.trace or ["mixtral", "qwen64-flat", "qwen128-skewed"]:
        layers, experts, top_k, targets, sequences, tokens, _ = traces[name]
        scored, _ = generate(layers, experts, top_k, 1, args.tokens, targets, seed=0)
        profiled, _ = generate(layers, experts, top_k, sequences, tokens, targets, seed=1)
        profile = RoutingProfile.from_trace(profiled, moe_layers=list(range(layers)), num_experts=experts,
                                            top_k=top_k)
        scored_tokens = tokens_from_trace(scored)
        calls = len(scored_tokens) * layers
        for size in (layers * top_k, layers * experts // 2):
            times = {scheme: [] for scheme in SCHEMES}
            hits = {}
            for _ in range(args.rounds):
                for scheme, options in SCHEMES.items():
                    start = time.process_time()
                    hits[scheme] = sim.simulate(scored_tokens, size, prior=profile, **options(profile))["hits"]
                    times[scheme].append((time.process_time() - start) / calls * 1e3)
            for policy, t in times.items():
                print(f"| {name} | {size} | {policy} | {' / '.join(f'{v:.3f}' for v in t)} | {hits[policy]} |")


if __name__ == "__main__":
    main()
