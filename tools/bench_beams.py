#!/usr/bin/env python
"""Beam search with its beams batched through each layer against the same beams run one at a time.

    python tools/bench_beams.py STORE [--beams 4] [--ram 25%] [--tokens 32] [--prompt TEXT] [--preload auto]
                                      [--compute auto]

Both runs are the same beam search (edgemoe.beam.beam_search, no stop tokens, so both take exactly
--tokens steps), each on a freshly opened store: "batched" feeds every beam's token to one forward
step, "one at a time" splits each decode step into one forward call per beam. Reported per output
token (one decode step: one more token of every beam and of the result): expert bytes read from
disk (model.store.stats.disk_bytes_read) and seconds. The prefill (the same single call in both) is
left out (the store's hit rate covers the whole run). A warm-up search first compiles the kernels, so neither run pays for it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import edgemoe
from edgemoe.beam import beam_search


class StepMeter:
    """Wraps model.forward: counts the decode steps' disk bytes and seconds; with one_at_a_time, runs
    each decode step as one forward call per beam. beam_search prefills through model.logits (all
    positions' logits) and decodes with last_only=True: that tells the two apart."""

    def __init__(self, model, one_at_a_time: bool):
        self.model, self.forward, self.one_at_a_time = model, model.forward, one_at_a_time
        self.steps, self.calls, self.disk_bytes, self.seconds = 0, 0, 0, 0.0
        model.forward = self

    def __call__(self, tokens: torch.Tensor, segments, last_only: bool = False) -> torch.Tensor:
        if not last_only:
            return self.forward(tokens, segments)
        before, start = self.model.store.stats.disk_bytes_read, time.perf_counter()
        if self.one_at_a_time:
            logits = torch.cat([self.forward(tokens[i:i + 1], [segment], last_only=True)
                                for i, segment in enumerate(segments)])
        else:
            logits = self.forward(tokens, segments, last_only=True)
        self.seconds += time.perf_counter() - start
        self.disk_bytes += self.model.store.stats.disk_bytes_read - before
        self.steps += 1
        self.calls += len(segments) if self.one_at_a_time else 1
        return logits


def measure(store: Path, prompt_ids: list[int], beams: int, tokens: int, store_options: dict,
            one_at_a_time: bool) -> tuple[dict, list]:
    with edgemoe.load(store, **store_options) as model:
        meter = StepMeter(model, one_at_a_time)
        hypotheses = beam_search(model, prompt_ids, beams, tokens, stop_token_ids=[])
        hit_rate = model.store.stats.hit_rate
    steps = meter.steps
    row = {"mode": "one at a time" if one_at_a_time else "batched", "decode_steps": steps,
           "forward_calls": meter.calls, "disk_MiB": meter.disk_bytes / 2**20,
           "disk_KiB_per_token": meter.disk_bytes / steps / 2**10, "ms_per_token": 1000 * meter.seconds / steps,
           "hit_rate": hit_rate}
    return row, hypotheses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--ram", default="25%", help="RAM for experts (bytes, or a share of the store's experts)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens: decode steps + 1 (the prefill's)")
    parser.add_argument("--prompt", default="To be, or not to be,")
    parser.add_argument("--preload", default="auto")
    parser.add_argument("--compute", default="auto", help="the experts' compute path (auto: by measured latency, "
                        "per token count: batched and single-token steps may take different paths)")
    args = parser.parse_args()
    store_options = {"ram": args.ram, "preload": args.preload, "compute": args.compute}
    if args.tokens < 2:
        parser.error(f"--tokens {args.tokens}: expected an integer >= 2 (at least one decode step)")

    with edgemoe.load(args.store, **store_options) as model:
        prompt_ids = model.tokenizer.encode(args.prompt)
        beam_search(model, prompt_ids, args.beams, 3, stop_token_ids=[])     # warm-up: compiles the kernels
    rows, results = [], []
    for one_at_a_time in (False, True):
        row, hypotheses = measure(args.store, prompt_ids, args.beams, args.tokens, store_options, one_at_a_time)
        rows.append(row)
        results.append([tokens for tokens, _ in hypotheses])
    print(f"store {args.store}, --beams {args.beams}, --ram {args.ram}, --preload {args.preload}, "
          f"--compute {args.compute}, --tokens {args.tokens}, prompt {args.prompt!r} ({len(prompt_ids)} tokens)")
    print("| mode | decode steps | forward calls | expert MiB read from disk | KiB read per output token "
          "| ms per output token | RAM hit rate |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['decode_steps']} | {r['forward_calls']} | {r['disk_MiB']:.2f} | "
              f"{r['disk_KiB_per_token']:.1f} | {r['ms_per_token']:.1f} | {r['hit_rate']:.3f} |")
    print(f"same hypotheses in both runs: {'yes' if results[0] == results[1] else 'no'}")


if __name__ == "__main__":
    main()
