"""Where a prefill's time goes: a prompt's forward pass (the last position's logits, as generation
takes them), with timers around the parts of each layer.

    python tools/profile_prefill.py STORE [--prefill 512] [--repeats 3] [--dense-bits 4] [--threads 2]

Loads STORE with every expert resident, runs one untimed prefill (compiles, calibrates the latency
model), then `--repeats` timed ones of random prompts with fresh caches, and prints each part's
median seconds:
- attention: the layers' attention blocks (norm, projections, rotary, cache, attention, output
  projection); of it, "sdpa": torch's scaled_dot_product_attention;
- routed experts: the MoE blocks' routed experts (StoreExperts.run: dequantize + GEMM, or the
  integer kernels for experts with few tokens);
- rest of the MLP blocks: routers, shared experts, dense MLP layers;
- head: the final norm and the LM head;
- outside: the rest (embedding, rotary tables, hooks, Python between the parts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from edgemoe.model import Segment
from profile_decode import CALLS, TOTALS, prefilled, timed   # tools/ is the script's directory, first on sys.path

PARTS = ("attention", "sdpa", "routed experts", "mlp blocks", "head")


def instrument(model) -> None:
    model._attention = timed("attention", model._attention)
    F.scaled_dot_product_attention = timed("sdpa", F.scaled_dot_product_attention)
    model.experts.run = timed("routed experts", model.experts.run)
    model._mlp = timed("mlp blocks", model._mlp)
    model.head = timed("head", model.head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-bits", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    model, _, _ = prefilled(args.store, args.threads, args.dense_bits, args.prefill, 0, False)
    instrument(model)
    generator = torch.Generator().manual_seed(1)
    runs = []
    for _ in range(args.repeats):
        TOTALS.clear()
        CALLS.clear()
        prompt = torch.randint(0, model.spec.vocab_size, (args.prefill,), generator=generator)
        start = time.perf_counter()
        model.forward(prompt, [Segment(model.new_cache(), args.prefill)], last_only=True)
        runs.append({"total": time.perf_counter() - start, **TOTALS})
    model.close()
    median = {part: statistics.median(run.get(part, 0.0) for run in runs) for part in ("total", *PARTS)}
    rest_of_mlp = median["mlp blocks"] - median["routed experts"]
    outside = median["total"] - median["attention"] - median["mlp blocks"] - median["head"]
    print(f"{args.store}: prefill {args.prefill} tokens, dense bits {args.dense_bits or 'as loaded'}, threads "
          f"{args.threads or 'auto'}, medians of {args.repeats}; load average {os.getloadavg()[0]:.2f}")
    print("totals, s: " + ", ".join(f"{run['total']:.3f}" for run in runs))
    rows = [("attention", median["attention"]), ("  of it sdpa", median["sdpa"]),
            ("routed experts", median["routed experts"]), ("rest of MLP blocks", rest_of_mlp),
            ("head", median["head"]), ("outside", outside), ("total", median["total"])]
    for name, seconds in rows:
        print(f"{name:>20} {seconds:8.3f} s {seconds / median['total']:6.1%}")


if __name__ == "__main__":
    main()
