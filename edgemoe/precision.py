"""The precision dense weight matrices are multiplied in, chosen by what the CPU computes natively.

A bfloat16 (or float16) checkpoint read as stored halves the bytes each token reads, which pays
where the CPU multiplies that type in hardware (x86 AVX-512 BF16 or AMX, Arm's BF16 / FP16
extensions). Elsewhere torch emulates it: on an AVX2-only Zen 3 a 1024x1024 bfloat16 `linear` took
1.8-2.0x float32's time at 1 token and 6.4-8.3x at 256 tokens (docs/benchmarks.md), so "auto" widens such
matrices to float32 there. An explicit dtype (--dtype) is always kept.
"""

from __future__ import annotations

import functools

import torch

# LLVM feature names of native reduced-precision arithmetic, per type.
NATIVE_FEATURES = {
    torch.bfloat16: ("avx512bf16", "amx-bf16", "bf16"),
    torch.float16: ("avx512fp16", "amx-fp16", "fullfp16"),
}


@functools.lru_cache(maxsize=1)
def native_types() -> frozenset:
    """The reduced-precision types this CPU multiplies in hardware."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    return frozenset(t for t, names in NATIVE_FEATURES.items() if any(features.get(n) for n in names))


def compute_dtype(stored: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """The dtype a matrix stored as `stored` is kept in: `requested` if given ("auto" is None), else
    the stored type where the CPU computes it natively, else float32."""
    if requested is not None:
        return requested
    if stored in NATIVE_FEATURES and stored not in native_types():
        return torch.float32
    return stored
