"""Dense matrix precision on this CPU: torch `linear` time of float32 against bfloat16 and float16
weights (float32 activations cast as edgemoe.layers.linear does), per token count and thread count.
Why `--dtype auto` widens reduced-precision matrices to float32 on CPUs without native support.

    python tools/bench_dense_dtype.py [--size 1024] [--tokens 1 256] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from edgemoe.layers import linear
from edgemoe.precision import native_types


def median_ms(fn, repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?") if os.path.exists("/proc/cpuinfo") else "?"
    print(f"{cpu}; native reduced precision: {sorted(str(t) for t in native_types()) or 'none'}; "
          f"load average {os.getloadavg()[0]:.2f}; {args.size}x{args.size} weight")
    print(f"{'threads':>7} {'tokens':>6} {'float32 ms':>10} {'bfloat16 ms':>11} {'x':>6} {'float16 ms':>10} {'x':>6}")
    weight = torch.randn(args.size, args.size)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.size)
            ms = {dt: median_ms(lambda w=weight.to(dt): linear(x, w)) for dt in (torch.float32, torch.bfloat16,
                                                                                   torch.float16)}
            f32 = ms[torch.float32]
            print(f"{threads:7} {tokens:6} {f32:10.3f} {ms[torch.bfloat16]:11.3f} {ms[torch.bfloat16] / f32:6.1f} "
                  f"{ms[torch.float16]:10.3f} {ms[torch.float16] / f32:6.1f}")


if __name__ == "__main__":
    main()
