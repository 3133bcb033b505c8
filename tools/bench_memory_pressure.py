#!/usr/bin/env python
"""Decode speed under memory pressure: schemes side by side at several RAM budgets, in one invocation.

    python tools/bench_memory_pressure.py --store int4=/tmp/s3b/int4 --ram 10% 25% 50% \\
        --case lru:int4 --case predictive:int4 --case "predictive:int4:fallback=0.3,skip=0.2" \\
        [--prefill 256] [--decode-tokens 16] [--repeats 3] [--json OUT]

A case is MODE:STORE[:OPTIONS]: MODE one of edgemoe bench's modes (lru is on-demand-lru), STORE a
label given by --store, OPTIONS comma-separated: the predictive mode's trade-offs (skip=W,
fallback=W) and parts of its scheme (policy=NAME, preload=PREDICTOR: the default's eviction or predictor
replaced, to break its cost down) and, for any mode, the disk tier's reads (io=direct|buffered; default direct). Every RAM
budget is a share of the FIRST store's expert bytes, so that a store of narrower experts (a --budget
store) gets the same bytes of RAM as the uniform store it is held against. Each run is cold (the
store's files dropped from the page cache), routed by generated Mixtral-like routing (the same trace
for every run, edgemoe.bench.generated_routing), and timed as `edgemoe bench` times it; runs are
interleaved case by case within each repeat, and a row is the median of its repeats. The ratio is
against the first case at the same budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from edgemoe.bench import (BenchConfig, generated_routing, machine_summary, measure_bandwidths, prompt_tokens,
                           run_once, warm_up)
from edgemoe.scheduling.policies import POLICIES
from edgemoe.scheduling.preload import PREDICTORS
from edgemoe.store import read_manifest

MODE_NAMES = {"lru": "on-demand-lru", "predictive": "predictive", "all-in-ram": "all-in-ram"}
TRADE_OFFS = {"skip": "skip_below", "fallback": "fallback_below"}   # predictive mode only
SCHEME_PARTS = {"policy": sorted(POLICIES), "preload": PREDICTORS}   # predictive mode only: the choices


def parse_case(text: str, stores: dict[str, Path]) -> dict:
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in MODE_NAMES or parts[1] not in stores:
        raise SystemExit(f"--case {text!r}: expected MODE:STORE[:skip=W,fallback=W], MODE in {sorted(MODE_NAMES)}, "
                         f"STORE in {sorted(stores)}")
    options = {}
    for item in filter(None, (parts[2] if len(parts) == 3 else "").split(",")):
        name, _, value = item.partition("=")
        if name == "io":
            options["io"] = value
        elif name in TRADE_OFFS:
            options[TRADE_OFFS[name]] = float(value)
        elif name in SCHEME_PARTS:
            if value not in SCHEME_PARTS[name]:
                raise SystemExit(f"--case {text!r}: {name}={value!r}: expected one of {', '.join(SCHEME_PARTS[name])}")
            options[name] = value
        else:
            raise SystemExit(f"--case {text!r}: unknown option {name!r} (expected skip=, fallback=, policy=, "
                             f"preload= or io=)")
    if set(options) - {"io"} and parts[0] != "predictive":
        raise SystemExit(f"--case {text!r}: the trade-offs and scheme parts apply to the predictive mode only")
    return {"label": text, "mode": MODE_NAMES[parts[0]], "store": stores[parts[1]], "options": options}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", action="append", required=True, help="LABEL=PATH (repeatable; the first sets "
                        "the RAM budgets)")
    parser.add_argument("--case", action="append", required=True)
    parser.add_argument("--ram", nargs="+", default=["25%"], help="shares of the first store's expert bytes")
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--warmup-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    args = parser.parse_args()

    stores = dict(item.split("=", 1) for item in args.store)
    stores = {label: Path(path) for label, path in stores.items()}
    cases = [parse_case(c, stores) for c in args.case]
    first = read_manifest(next(iter(stores.values())))
    budgets = [(share, int(first.expert_bytes * float(share.rstrip("%")) / 100)) for share in args.ram]
    steps = args.warmup_tokens + args.decode_tokens
    replay, profile = generated_routing(first.spec, args.prefill + steps)
    base = BenchConfig(ram=0, prefill_tokens=(args.prefill,), decode_tokens=args.decode_tokens,
                       warmup_tokens=args.warmup_tokens, repeats=1, cold=True, replay=replay,
                       routing_profile=profile, threads=args.threads)
    for path in stores.values():
        warm_up(path, base)
    bandwidths = measure_bandwidths(next(iter(stores.values())))
    print(machine_summary(bandwidths))
    print(f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; routing: generated Mixtral-like (model seed 0); "
          f"prompt {args.prefill}, {args.warmup_tokens} + {args.decode_tokens} decode tokens, cold, "
          f"{args.repeats} repeats; load average {os.getloadavg()[0]:.2f}", flush=True)
    prompt = prompt_tokens(first.spec.vocab_size, args.prefill, 0)
    runs = []
    for share, ram in budgets:
        for repeat in range(args.repeats):
            for case in cases:
                config = replace(base, ram=ram, **case["options"])
                record = run_once(case["store"], case["mode"], prompt, config, bandwidths)
                runs.append({"ram_share": share, "case": case["label"], "repeat": repeat, **record})
                print(f"  {share} {case['label']}: {record['decode_tok_s']:.2f} tok/s, "
                      f"{record['disk_bytes_per_token'] / 2**20:.1f} MiB/token", flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print_table(runs, budgets, cases)


def print_table(runs: list[dict], budgets, cases) -> None:
    print("\n| RAM | case | decode tok/s | vs first case | disk MiB/token | hit rate | I/O wait ms/token | "
          "preloads/token (used) | skipped / fallback uses per token | CPU in reads / loader CPU, ms/token |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|---|")
    for share, ram in budgets:
        medians = {}
        for case in cases:
            mine = [r for r in runs if r["ram_share"] == share and r["case"] == case["label"]]
            medians[case["label"]] = {key: statistics.median(r[key] for r in mine) for key in (
                "decode_tok_s", "disk_bytes_per_token", "hit_rate", "decode_io_wait_s_per_token",
                "decode_preloads_per_token", "decode_preloads_used_per_token", "decode_skipped_per_token",
                "decode_fallback_uses_per_token", "decode_read_cpu_s_per_token", "decode_loader_cpu_s_per_token")}
        reference = medians[cases[0]["label"]]["decode_tok_s"]
        for case in cases:
            m = medians[case["label"]]
            print(f"| {share} ({ram / 2**20:.0f} MiB) | {case['label']} | {m['decode_tok_s']:.2f} | "
                  f"{m['decode_tok_s'] / reference:.2f}x | {m['disk_bytes_per_token'] / 2**20:.1f} | "
                  f"{m['hit_rate']:.3f} | {1000 * m['decode_io_wait_s_per_token']:.0f} | "
                  f"{m['decode_preloads_per_token']:.1f} ({m['decode_preloads_used_per_token']:.1f}) | "
                  f"{m['decode_skipped_per_token']:.2f} / {m['decode_fallback_uses_per_token']:.2f} | "
                  f"{1000 * m['decode_read_cpu_s_per_token']:.0f} / {1000 * m['decode_loader_cpu_s_per_token']:.0f} |")


if __name__ == "__main__":
    main()
