"""What the second thread buys a decode token: one process, the thread counts alternating token by
token (so that the machine's drift between processes, often 20% here, does not enter the ratio).

    python tools/profile_threads.py STORE [--threads 1 2] [--tokens 240] [--prefill 512] [--dense-bits 4]

Loads STORE with every expert in RAM, routes by a generated Mixtral-like trace (as `edgemoe bench`
does), prefills, then decodes --tokens tokens, token i at --threads[i mod n] threads. Prints, per
thread count, the median wall time of a token and of its decode-engine call (every layer in one
kernel call), and the fastest token. Under `perf record -g -p PID` it also shows where each thread
spends a token (docs/benchmarks.md: how long the numba worker waits in libgomp).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgemoe.kernels import cpu_layer, set_threads
from edgemoe.model import Segment
from profile_decode import prefilled   # tools/ is the script's directory, first on sys.path

WARM_TOKENS = 10   # first tokens, not counted: each thread count's first calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=240)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--dense-bits", type=int, default=4)
    args = ap.parse_args()
    model, cache, token = prefilled(args.store, max(args.threads), args.dense_bits, args.prefill,
                                    WARM_TOKENS + args.tokens, generated_routing=True)
    if model.decode_engine is None:
        raise SystemExit(f"{args.store}: no decode engine for this model (see docs/architecture.md)")
    kernel_seconds = [0.0]
    step = cpu_layer.decode_token_kernel

    def timed_step(*a):
        start = time.perf_counter()
        try:
            return step(*a)
        finally:
            kernel_seconds[0] = time.perf_counter() - start
    cpu_layer.decode_token_kernel = timed_step   # the engine looks the kernel up on the module at each call
    times: dict[int, list[tuple[float, float]]] = {n: [] for n in args.threads}
    print(f"decoding {args.tokens} tokens (attach perf now)", flush=True)
    for i in range(WARM_TOKENS + args.tokens):
        threads = args.threads[i % len(args.threads)]
        set_threads(threads)
        start = time.perf_counter()
        token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)[-1].argmax())
        if i >= WARM_TOKENS:
            times[threads].append((time.perf_counter() - start, kernel_seconds[0]))
    model.close()
    for threads, pairs in times.items():
        tokens, kernels = zip(*pairs)
        print(f"threads {threads}: token median {statistics.median(tokens) * 1e3:.2f} ms, decode-engine call median "
              f"{statistics.median(kernels) * 1e3:.2f} ms, fastest token {min(tokens) * 1e3:.2f} ms ({len(tokens)} tokens)")


if __name__ == "__main__":
    main()
