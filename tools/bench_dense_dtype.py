"""Dense matrix precision on this CPU: torch `linear` time of float32 against bfloat16 and float16
weights (float32 activations cast as edgemoe.layers.linear does), and of the INT8 / INT4 matrices of
--dense-bits (edgemoe.dense) on the integer kernel and by dequantize + GEMM, per token count and
thread count. Why `--dtype auto` widens reduced-precision matrices to float32 on CPUs without native
support, and where a QuantizedLinear switches from the kernel to the GEMM (KERNEL_MAX_TOKENS); the
last column is the GEMM of a bfloat16 model's INT8 matrix (dequantized to bfloat16).

    python tools/bench_dense_dtype.py [--size 1024] [--rows R] [--tokens 1 4 8 16 256] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from edgemoe import kernels
from edgemoe.dense import quantize_matrix
from edgemoe.kernels._jit import set_threads
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
    parser.add_argument("--size", type=int, default=1024, help="columns (and rows unless --rows)")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    rows = args.rows or args.size
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?") if os.path.exists("/proc/cpuinfo") else "?"
    print(f"{cpu}; native reduced precision: {sorted(str(t) for t in native_types()) or 'none'}; "
          f"load average {os.getloadavg()[0]:.2f}; {rows}x{args.size} weight; ms, medians of 15")
    print(f"{'threads':>7} {'tokens':>6} {'float32':>8} {'bfloat16':>8} {'float16':>8} "
          f"{'int8 kernel':>11} {'int8 GEMM':>9} {'int4 kernel':>11} {'int4 GEMM':>9} {'int8 bf16 GEMM':>14}")
    weight = torch.randn(rows, args.size)
    quantized = {bits: quantize_matrix(weight, bits).qt for bits in (8, 4)}
    for threads in args.threads:
        torch.set_num_threads(threads)
        set_threads(threads)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.size)
            xn = x.numpy()
            ms = [median_ms(lambda w=weight.to(dt): linear(x, w)) for dt in (torch.float32, torch.bfloat16,
                                                                              torch.float16)]
            for qt in quantized.values():
                ms.append(median_ms(lambda qt=qt: kernels.qmatmul_int(xn, qt)))
                ms.append(median_ms(lambda qt=qt: F.linear(x, kernels.dequantize(qt))))
            # a bfloat16 model's QuantizedLinear on a long step: dequantized to bfloat16, one bfloat16 GEMM
            xb = x.to(torch.bfloat16)
            ms.append(median_ms(lambda: F.linear(xb, kernels.dequantize(quantized[8], torch.bfloat16)).float()))
            print(f"{threads:7} {tokens:6} " + " ".join(f"{v:{w}.3f}" for v, w in zip(ms, (8, 8, 8, 11, 9, 11, 9, 14))))

if __name__ == "__main__":
    main()
