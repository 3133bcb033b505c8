"""One token through a grouped matrix (the dense default of a 4-bit store: INT4 in groups of 128) on
each integer path this CPU runs, at 1 and 2 threads, hot (one copy, in cache: the decoding ceiling)
and cold (a different copy each call, from a set larger than the last-level cache).

    python tools/bench_grouped_rows.py [--shape 1024x1024 --shape 32000x1024] [--bits 4] [--group 128]

Prints one line per (shape, path, threads): medians over --repeats calls of qmatmul_int, in us, and
the packed bytes' read rate of the cold calls. Run it on the code before and after a kernel change,
one after the other, on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from edgemoe.kernels import int_paths, set_threads
from edgemoe.kernels.ops import qmatmul_int
from edgemoe.quant.tensor import quantize

COLD_SET_BYTES = 512 << 20   # the cold calls cycle through this much: more than any last-level cache here


def timed(x, matrices, path, repeats):
    """Median seconds of one call, cycling through `matrices`."""
    qmatmul_int(x, matrices[0], path)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        qmatmul_int(x, matrices[i % len(matrices)], path)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help="ROWSxCOLS (default: 1024x1024 and 32000x1024)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    for shape in args.shape or ["1024x1024", "32000x1024"]:
        rows, cols = map(int, shape.split("x"))
        one = quantize(torch.randn(rows, cols), args.bits, args.group)
        packed_bytes = rows * cols * args.bits // 8
        copies = [one] + [quantize(torch.randn(rows, cols), args.bits, args.group)
                          for _ in range(max(1, COLD_SET_BYTES // packed_bytes) - 1)]
        x = np.random.default_rng(0).standard_normal((1, cols)).astype(np.float32)
        for path in int_paths():
            for threads in (1, 2):
                set_threads(threads)
                hot = timed(x, [one], path, args.repeats)
                cold = timed(x, copies, path, max(args.repeats, len(copies)))
                print(f"{shape} INT{args.bits} g{args.group} {path:>10} {threads} thr: hot {hot * 1e6:8.1f} us, "
                      f"cold {cold * 1e6:8.1f} us ({packed_bytes / cold / 1e9:5.1f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
