#!/usr/bin/env python
"""Speculative decoding against plain decoding: acceptance, prefetch precision, time per output token.

    python tools/bench_speculative.py [--store STORE] [--ram 25%] [--tokens 64] [--speculate 2 4]
                                      [--draft self] [--temperature 0] [--prompts 4] [--probe 0 4]
                                      [--prefetch on [off]] [--breakdown]

Runs, on the bundled model's checkpoint (all in RAM) and on STORE (default: the bundled model
converted to INT4 with 2-bit fallback copies in a temporary directory) with --ram, each of: plain
decoding (generate.stream_tokens) and speculative decoding (edgemoe.speculative) with each
--speculate n, each --draft (self: the self-draft, from the store's fallback copies or INT2 copies
of a checkpoint's experts; a path: a separate draft) and each --probe (tokens measured plainly,
then speculatively, before speculation is turned off where it reads more per token; 0: never
off; only under a RAM budget, so the checkpoint runs once with 0) and each --prefetch (off: the
draft prefetches nothing, to see what its prefetch reads; only from the store). Every run opens a fresh
model and decodes the same --prompts prompts, the first lines of the bundled model's held-out
text, --tokens tokens each (no stop tokens). A warm-up run first compiles the kernels. Reported
per configuration: milliseconds per output token after the first (decode only, prefill left
out), the draft's and the verification's milliseconds per round, acceptance rate, prefetched
experts and their precision (used by the verification that followed / prefetched), expert
bytes read from disk per output token (prefill included) and of them the fallback copies' (the
draft's reads: copies read x their mean size), whether the probe turned speculation off, the
self-draft's INT2 copy size (a checkpoint's), and whether greedy output equals plain decoding's.
--breakdown: also, per speculative run from the store, its bytes read per output token by what
read them (ReadBreakdown). Also: the cost of building the INT2 copy of every
expert at load (the alternative to building each the first time it is used).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.convert import convert
from edgemoe.generate import GenerationOptions, stream_tokens
from edgemoe.speculative import PROBE_TOKENS, LowWidthExperts, speculator_for


def prompts(count: int) -> list[str]:
    lines = [l for l in (bundled_model_path() / "eval.txt").read_text().splitlines() if len(l.strip()) > 20]
    return lines[:count]


class ReadBreakdown:
    """A speculative run's store reads, by what read them: the draft's own reads (its thread, while
    it drafts: fallback copies), reads by the loader while the draft runs (its prefetches), the
    verification's reads of experts prefetched in the same round (evicted before it used them) and
    of others, and the rest (prefill, plain steps). Wraps the store's disk reads and the round's two
    halves of this one Speculator, for this tool only."""

    def __init__(self, speculator):
        self.bytes: dict[str, int] = {}
        self.phase = "other"
        store, caller = speculator.target.store, threading.current_thread()
        read, propose, verify = store.disk.read, speculator._propose, speculator._verify

        def counted_read(entry, **kwargs):
            blob = read(entry, **kwargs)
            self._count(entry, threading.current_thread() is caller, speculator._round_prefetched)
            return blob

        def in_phase(phase, method):
            def wrapped(*args, **kwargs):
                self.phase = phase
                try:
                    return method(*args, **kwargs)
                finally:
                    self.phase = "other"
            return wrapped

        store.disk.read = counted_read
        speculator._propose, speculator._verify = in_phase("draft", propose), in_phase("verify", verify)
        self.copies = {(e.file, e.offset) for e in store.manifest.fallback.values()}

    def _count(self, entry, by_caller: bool, prefetched: set) -> None:
        copy = (entry.file, entry.offset) in self.copies
        if self.phase == "draft":
            what = "draft: copies" if copy else ("draft: experts" if by_caller else "draft: loader (prefetch)")
        elif self.phase == "verify":
            what = "verify: prefetched this round, read again" if entry.key in prefetched else "verify: others"
        else:
            what = "prefill and plain steps"
        self.bytes[what] = self.bytes.get(what, 0) + entry.stored_length


def run(path: Path, ram, texts: list[str], opts: GenerationOptions, draft: str | None, n: int,
        probe: int = 0, prefetch: bool = True, breakdown: bool = False) -> dict:
    store_options = {} if ram is None else {"ram": ram}
    with edgemoe.load(path, **store_options) as model:
        speculator = speculator_for(model, draft, n, probe_tokens=probe) if draft else None
        reads = None
        if speculator is not None:
            speculator.prefetches = speculator.prefetches and prefetch
            if breakdown and model.store is not None:
                reads = ReadBreakdown(speculator)
        outputs, decode_seconds, decode_tokens = [], 0.0, 0
        for text in texts:
            ids = model.tokenizer.encode(text)
            model.timings.reset()
            if speculator is None:
                outputs.append(list(stream_tokens(model, ids, opts)))
                decode_seconds += sum(s for _, s in model.timings.per_step[1:])
                decode_tokens += len(outputs[-1]) - 1
            else:
                outputs.append(list(speculator.stream(ids, opts, warn=lambda message: print(message))))
        row = {"draft": draft or "plain", "n": n if draft else None, "probe": probe if draft else None,
               "prefetch": ("on" if prefetch else "off") if draft else "-"}
        if speculator is not None:
            s = speculator.stats
            decode_seconds, decode_tokens = s.decode_seconds, s.emitted - len(texts)
            row.update(acceptance=s.acceptance_rate, rounds=s.rounds, prefetched=s.prefetched,
                       draft_ms_per_round=1000 * s.draft_seconds / s.rounds if s.rounds else None,
                       verify_ms_per_round=1000 * s.verify_seconds / s.rounds if s.rounds else None,
                       prefetch_precision=s.prefetch_precision, draft_copy_mib=None if s.draft_copy_bytes is None
                       else s.draft_copy_bytes / 2**20, off="yes" if s.off else "no")
            speculator.close()
        row["ms_per_token"] = 1000 * decode_seconds / decode_tokens
        if model.store is not None:
            tokens = sum(len(o) for o in outputs)
            row["disk_mib_per_token"] = model.store.stats.disk_bytes_read / 2**20 / tokens
            row["copy_mib_per_token"] = model.store.stats.fallback_reads * mean_copy_bytes(model.store) / 2**20 / tokens
            if reads is not None:
                row["breakdown"] = {what: b / 2**20 / tokens for what, b in sorted(reads.bytes.items())}
    return {**row, "outputs": outputs}


def mean_copy_bytes(store) -> float:
    copies = store.manifest.fallback.values()
    return sum(e.stored_length for e in copies) / len(copies) if copies else 0.0


def copy_at_load_cost(path: Path) -> dict:
    """Seconds to re-quantize every expert of a freshly opened model to INT2 (what building the copy
    at load would add to start-up), and the copy's bytes."""
    with edgemoe.load(path) as model:
        experts = LowWidthExperts(model.experts)
        start = time.perf_counter()
        for l in model.spec.moe_layer_ids:
            for e in range(model.spec.num_experts):
                experts.expert(l, e)
        seconds = time.perf_counter() - start
        expert_bytes = model.store.manifest.expert_bytes if model.store is not None else None
    return {"seconds": seconds, "copy_mib": experts.nbytes / 2**20, "experts": experts.built,
            "stored_expert_mib": None if expert_bytes is None else expert_bytes / 2**20}


def table(rows: list[dict]) -> None:
    def fmt(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    print("| model | draft | n | probe | prefetch | ms/token | draft ms/round | verify ms/round | acceptance | prefetched "
          "| prefetch precision | disk MiB/token | copies MiB/token | off | INT2 copy MiB | same as plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['draft']} | {fmt(r['n'], 'd')} | {fmt(r['probe'], 'd')} | {r['prefetch']} "
              f"| {r['ms_per_token']:.1f} "
              f"| {fmt(r.get('draft_ms_per_round'), '.1f')} | {fmt(r.get('verify_ms_per_round'), '.1f')} "
              f"| {fmt(r.get('acceptance'))} "
              f"| {fmt(r.get('prefetched'), 'd')} | {fmt(r.get('prefetch_precision'))} "
              f"| {fmt(r.get('disk_mib_per_token'), '.3f')} | {fmt(r.get('copy_mib_per_token'), '.3f')} "
              f"| {r.get('off', '-')} | {fmt(r.get('draft_copy_mib'), '.1f')} | {r['same']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, help="a store (default: the bundled model converted to INT4)")
    parser.add_argument("--ram", default="25%")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--speculate", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--draft", nargs="+", default=["self"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--probe", type=int, nargs="+", default=[0, PROBE_TOKENS],
                        help="speculation's probe tokens under --ram (0: never turned off)")
    parser.add_argument("--prefetch", nargs="+", choices=["on", "off"], default=["on"],
                        help="the draft's prefetch, from the store (off: to see what it reads)")
    parser.add_argument("--breakdown", action="store_true",
                        help="per speculative run from the store, its bytes read by what read them")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    texts = prompts(args.prompts)
    opts = GenerationOptions(max_new_tokens=args.tokens, temperature=args.temperature, seed=0, stop_token_ids=[])
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store
        if store is None:
            store = Path(tmp) / "bundled-int4"
            convert(bundled_model_path(), store, bits=4, fallback_bits=2)
        run(store, None, texts[:1], GenerationOptions(max_new_tokens=8), "self", 2)   # compile the kernels
        rows = []
        for name, path, ram in (("bundled checkpoint", bundled_model_path(), None),
                                (f"store, --ram {args.ram}", store, args.ram)):
            plain = run(path, ram, texts, opts, None, 0)
            rows.append({**plain, "model": name, "same": "-"})
            for draft in args.draft:
                for n in args.speculate:
                    for probe in args.probe if ram is not None else [0]:
                        for prefetch in args.prefetch if ram is not None else ["on"]:
                            row = run(path, ram, texts, opts, draft, n, probe, prefetch == "on", args.breakdown)
                            same = row["outputs"] == plain["outputs"]
                            rows.append({**row, "model": name,
                                         "same": same if args.temperature == 0 else "(sampled)"})
        table(rows)
        print()
        for r in rows:
            if "breakdown" in r:
                parts = ", ".join(f"{what} {mib:.3f}" for what, mib in r["breakdown"].items())
                print(f"reads, MiB per output token, n = {r['n']}, probe {r['probe']}, prefetch {r['prefetch']}: {parts}")
        print()
        for name, path in (("bundled checkpoint", bundled_model_path()), ("store", store)):
            cost = copy_at_load_cost(path)
            print(f"INT2 copy of every expert at load, {name}: {cost['seconds']:.2f} s for {cost['experts']} experts, "
                  f"{cost['copy_mib']:.1f} MiB" + ("" if cost["stored_expert_mib"] is None
                                                  else f" (stored experts: {cost['stored_expert_mib']:.1f} MiB)"))
        if args.json:
            print(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
