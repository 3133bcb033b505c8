"""One decoder layer's attention block for one token (DecodeEngine.layer: norm, q/k/v, rotary, the
cache write, attention over the cache, o, residual, norm, router logits) at several cache positions:
position 0 is the projections and fixed costs alone, the growth with the position is attention over
the cache.

    python tools/bench_attention_block.py STORE [--threads 1] [--positions 0 128 512 1024]

Loads STORE with its dense matrices at --dense-bits (default 4), fills a KV cache with a random prompt
longer than the last position, then times every layer's block at each position: ms per layer, the
minimum and the median of --passes passes over all layers (each call includes its Python, ~20 us).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import edgemoe
from edgemoe.kernels import cpu_layer
from edgemoe.model import Segment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dense-bits", type=int, default=4)
    ap.add_argument("--positions", type=int, nargs="+", default=[0, 128, 512, 1024])
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = edgemoe.load(args.store, threads=args.threads, dense_bits=args.dense_bits)
    engine = model.decode_engine
    if engine is None:
        raise SystemExit(f"{args.store}: no decode engine for this model (see docs/architecture.md)")
    cache = model.new_cache()
    filled = max(args.positions) + 1
    model.forward(torch.randint(0, model.spec.vocab_size, (filled,)), [Segment(cache, filled)], last_only=True)
    x = torch.randn(1, model.spec.hidden_size)
    dk = int(engine.dims[cpu_layer.DIM_DK])
    cos, sin = torch.ones(1, dk), torch.zeros(1, dk)
    layers = len(engine.tables)
    for position in args.positions:
        passes = []
        for _ in range(args.passes):
            start = time.perf_counter()
            for layer in range(layers):
                engine.layer(layer, x, position, cos, sin, cache)
            passes.append((time.perf_counter() - start) / layers)
        print(f"position {position}: {min(passes) * 1e3:.3f} ms a layer (min of {args.passes}), "
              f"median {statistics.median(passes) * 1e3:.3f}", flush=True)
    model.close()


if __name__ == "__main__":
    main()
