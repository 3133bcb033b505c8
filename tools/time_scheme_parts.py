#!/usr/bin/env python
"""Where the scheme's bookkeeping time goes in a real decode: wall time inside the store's and the
cache's entry points, per decoded token, for cases of tools/bench_memory_pressure.py run side by side.

    python tools/time_scheme_parts.py --store int4=STORE --ram 25% --case lru:int4 --case predictive:int4 \\
        [--prefill 32] [--decode-tokens 48] [--warmup-tokens 8] [--rounds 2]

Each run is bench_memory_pressure's (generated Mixtral-like routing, the routing profile of another
text, cold), with a timer around each entry point below; the times are summed over the whole run
(prefill and warm-up included) and divided by the decoded tokens, so they are for comparing cases,
not a token's exact split. Nested entry points count in both (TieredStore.begin_layer holds
ExpertCache.begin_layer, which holds AdaptivePolicy.set_layer: the ghosts' pass). Reads run on the
reader threads as well as the caller's (TieredStore._read counts both). A store copied to a tmpfs
(/dev/shm) reads at memory speed, which leaves the CPU's part alone.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import time
from dataclasses import replace
from pathlib import Path

from edgemoe import quantized
from edgemoe.bench import BenchConfig, generated_routing, machine_summary, measure_bandwidths, prompt_tokens, run_once
from edgemoe.scheduling import cache, guard, policies, preload
from edgemoe.store import read_manifest, tiers

ENTRY_POINTS = [
    (quantized.StoreExperts, ("prepare", "run")),
    (tiers.TieredStore, ("begin_layer", "get", "get_resident", "prefetch", "admit", "_read", "_load_one")),
    (cache.ExpertCache, ("begin_layer", "request", "place", "admit")),
    (policies.AdaptivePolicy, ("set_layer",)),
    (guard.SchemeGuard, ("observe_layer",)),
    (preload.Preloader, ("on_routing",)),
]


def timed(seconds: dict[str, float]) -> None:
    """Wrap every entry point so that its wall time adds to seconds[Class.method]."""
    for owner, names in ENTRY_POINTS:
        for name in names:
            function, label = getattr(owner, name), f"{owner.__name__}.{name}"

            def wrapper(*args, _function=function, _label=label, **kwargs):
                start = time.perf_counter()
                try:
                    return _function(*args, **kwargs)
                finally:
                    seconds[_label] = seconds.get(_label, 0.0) + time.perf_counter() - start
            setattr(owner, name, functools.wraps(function)(wrapper))


def _pressure_tool():
    path = Path(__file__).with_name("bench_memory_pressure.py")
    spec = importlib.util.spec_from_file_location("bench_memory_pressure", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", action="append", required=True, help="LABEL=PATH (repeatable)")
    parser.add_argument("--case", action="append", required=True, help="as tools/bench_memory_pressure.py's")
    parser.add_argument("--ram", default="25%", help="a share of the first store's expert bytes")
    parser.add_argument("--prefill", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    stores = {label: Path(path) for label, path in (item.split("=", 1) for item in args.store)}
    cases = [_pressure_tool().parse_case(c, stores) for c in args.case]
    first = read_manifest(next(iter(stores.values())))
    replay, profile = generated_routing(first.spec, args.prefill + args.warmup_tokens + args.decode_tokens)
    config = BenchConfig(ram=int(first.expert_bytes * float(args.ram.rstrip("%")) / 100), prefill_tokens=(args.prefill,),
                         decode_tokens=args.decode_tokens, warmup_tokens=args.warmup_tokens, repeats=1, cold=True,
                         replay=replay, routing_profile=profile, threads=args.threads)
    bandwidths = measure_bandwidths(next(iter(stores.values())))
    print(machine_summary(bandwidths))
    prompt = prompt_tokens(first.spec.vocab_size, args.prefill, 0)
    seconds: dict[str, float] = {}
    timed(seconds)
    for round_ in range(args.rounds):
        for case in cases:
            seconds.clear()
            record = run_once(case["store"], case["mode"], prompt, replace(config, **case["options"]), bandwidths)
            parts = ", ".join(f"{label} {1e3 * s / args.decode_tokens:.1f}" for label, s in sorted(seconds.items()))
            print(f"round {round_} {case['label']}: {record['decode_tok_s']:.2f} tok/s, I/O wait "
                  f"{1e3 * record['decode_io_wait_s_per_token']:.0f} ms/token; ms per decoded token: {parts}", flush=True)


if __name__ == "__main__":
    main()
