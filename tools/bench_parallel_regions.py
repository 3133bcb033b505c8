"""The fixed cost of one numba parallel region (a prange loop) on the "omp" threading layer the
kernels use, at each thread count: a call running N regions of two trivial iterations each.

    python tools/bench_parallel_regions.py [--regions 2000]

A decode token of the engine makes about 8 such regions a layer (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from edgemoe.kernels import set_threads   # also selects the omp threading layer
from edgemoe.kernels._jit import available_cores


@numba.njit(parallel=True)
def regions(n, a):
    for _ in range(n):
        for b in numba.prange(2):
            a[b] += 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regions", type=int, default=2000)
    args = ap.parse_args()
    a = np.zeros(2)
    for threads in range(1, available_cores() + 1):
        set_threads(threads)
        regions(10, a)
        best = min(_timed(regions, args.regions, a) for _ in range(5))
        print(f"threads {threads}: {best / args.regions * 1e6:.2f} us a region")


def _timed(fn, n, a) -> float:
    start = time.perf_counter()
    fn(n, a)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
