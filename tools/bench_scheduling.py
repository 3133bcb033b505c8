#!/usr/bin/env python
"""Expert-cache hit rates of the runtime against the simulator, on one store and one text.

    python tools/bench_scheduling.py STORE --text eval.txt --ram-fraction 0.25 [--tokens 2000] [--json]

Decodes the text token by token through the store (teacher forcing: the text's own next token is fed,
so every configuration sees the same routing), with a RAM budget of --ram-fraction of the expert
bytes, for each (eviction policy, preload) pair; records the routing trace and replays it through
edgemoe/scheduling/simulate.py with a cache of the same number of experts. The store's routing profile
(edgemoe profile, from the calibration text) is the correlation table of both.
"""

from __future__ import annotations

import argparse

import json
import platform
import time
from pathlib import Path

import edgemoe
from edgemoe.store.profile_file import load_routing_profile
from edgemoe.store import read_manifest
from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.profile import tokens_from_trace
from edgemoe.tracing import TraceRecorder

CONFIGS = [("lru", "none"), ("lfu", "none"), ("frequency-distance", "none"), ("lru", "correlation"),
           ("frequency-distance", "correlation"), ("frequency-distance", "lookahead")]


def run_runtime(store, ids, ram: int, policy: str, preload: str) -> dict:
    model = edgemoe.load(store, ram=ram, policy=policy, preload=preload, place_popular=False)
    cache = model.new_cache()
    start = time.perf_counter()
    with TraceRecorder(model) as recorder:
        for token in ids:
            model.logits([token], cache)
    seconds = time.perf_counter() - start
    st = model.store.stats
    result = {"policy": policy, "preload": preload, "hit_rate": st.hit_rate, "requests": st.requests,
              "preloads": st.preloads_loaded, "preloads_cancelled": st.preloads_cancelled,
              "preload_precision": (st.preloads_used / st.preloads_loaded
                                                                    if st.preloads_loaded else None),
              "predictor_precision": model.preloader.precision if preload != "none" else None,
              "tokens_per_s": len(ids) / seconds}
    model.close()
    return result, recorder.records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--ram-fraction", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    manifest = read_manifest(args.store)
    sizes = [e.length for e in manifest.experts.values()]
    cache_experts = int(args.ram_fraction * len(sizes))
    ram = cache_experts * max(sizes)
    probe = edgemoe.load(args.store, preload="none")
    ids = probe.tokenizer.encode(args.text.read_text(), add_special_tokens=False)[:args.tokens]
    profile = load_routing_profile(args.store)

    rows = []
    for policy, preload in CONFIGS:
        runtime, records = run_runtime(args.store, ids, ram, policy, preload)
        tokens = tokens_from_trace(records)
        simulated = (sim.simulate(tokens, cache_experts, policy, preload_profile=profile, prior=profile)
                     if preload == "correlation" else sim.simulate(tokens, cache_experts, policy, prior=profile)
                     if preload == "none" else None)
        rows.append({**runtime, "cache_experts": cache_experts, "ram_bytes": ram,
                     "simulated_hit_rate": simulated["hit_rate"] if simulated else None})
    belady = sim.simulate(tokens, cache_experts, "belady")
    rows.append({"policy": "belady", "preload": "none", "cache_experts": cache_experts, "hit_rate": None,
                 "simulated_hit_rate": belady["hit_rate"]})
    if args.json:
        print(json.dumps({"machine": platform.platform(), "store": str(args.store), "text": str(args.text),
                          "tokens": len(ids), "rows": rows}, indent=1))
        return
    print(f"{args.store}: {len(sizes)} experts, cache {cache_experts} experts ({ram} bytes), {len(ids)} tokens "
          f"of {args.text}")
    print(f"{'policy':8} {'preload':12} {'runtime hit':>11} {'simulated':>9} {'preload prec.':>13} {'loaded':>7} "
          f"{'cancelled':>9} {'tok/s':>7}")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{r['policy']:8} {r['preload']:12} {fmt(r['hit_rate']):>11} {fmt(r['simulated_hit_rate']):>9} "
              f"{fmt(r.get('preload_precision')):>13} {r.get('preloads', 0):7d} {r.get('preloads_cancelled', 0):9d} "
              f"{r.get('tokens_per_s', 0):7.1f}")


if __name__ == "__main__":
    main()
