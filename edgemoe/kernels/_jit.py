"""Every numba option edgemoe's kernels use, and the one place thread counts are set.

Threads. numba and torch each keep a pool; set_threads(n) sizes both (default: every core the
process may run on, 2 here), and importing this module caps numba's at those cores. The runtime
calls them one after the other, never at the same time, so each pool gets all cores in turn.
numba runs on its "omp" threading layer (thread-safe, so a background loader thread may also call
a kernel); torch ships its own OpenMP runtime (a second libgomp), whose threads spin for a while
after each parallel region: docs/benchmarks.md measured no cost for a numba kernel that follows a
torch op. Each runtime keeps a team of workers per thread that calls it: call the kernels of a
step from one thread (a second team makes the workers sleep between regions: docs/serving.md).

Determinism. Kernels are parallel over output rows only: every output element is computed by one
thread in a fixed order, so results do not depend on the thread count (nor, for qmatmul, on the
batch a token comes in: see edgemoe/kernels/cpu.py). Under CPU contention keep threads at 1: a parallel
region waits for its slowest thread, and a descheduled one costs a scheduler time slice (measured
~12 ms per call on this machine while another process held a core).

fastmath: reassociation lets LLVM vectorize the dot-product reductions (without it they stay
scalar), contraction allows FMA. No nnan/ninf: padding and zero rows must behave as IEEE says.
cache=True: compiled kernels are cached next to the source (__pycache__), keyed by CPU and features.

Vector width. LLVM's tuning for recent Intel cores ("prefer-256-bit") keeps loops at 256 bits even
with AVX-512; decoding codes costs a fixed number of instructions per vector, so 512-bit vectors
halve it (docs/benchmarks.md measures both). On AVX-512 hosts the feature is turned off for the
whole process, before numba's code generator starts (it reads the features once), unless the user
set NUMBA_CPU_FEATURES. If numba already compiled something before this module was imported, the
setting cannot apply: a warning says so (results then differ in the last bits from 512-bit runs).
"""

from __future__ import annotations

import functools
import os
import warnings

import llvmlite.binding as llvm
import numba
import torch
from numba.core.registry import cpu_target

numba.config.THREADING_LAYER = "omp"


def _allow_512_bit_vectors() -> None:
    if numba.config.CPU_FEATURES is not None:  # the user's NUMBA_CPU_FEATURES wins
        return
    features = llvm.get_host_cpu_features()
    if not features.get("avx512bw"):  # not an AVX-512 x86 host: nothing to change
        return
    if "target_context" in vars(cpu_target):  # code generator already built with its features
        warnings.warn("edgemoe.kernels imported after numba compiled code: kernels use LLVM's default "
                      "vector width", RuntimeWarning, stacklevel=3)
        return
    numba.config.CPU_FEATURES = features.flatten() + ",-prefer-256-bit"


_allow_512_bit_vectors()

FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
SERIAL = dict(fastmath=FASTMATH, cache=True, nogil=True)
PARALLEL = dict(SERIAL, parallel=True)
EXACT = dict(cache=True, nogil=True)  # elementwise, bit-exact vs torch: no fastmath
# Small helpers called once per row: inlined into their caller, so that numba passes no array
# structs by value per call (the small rows of fine-grained experts are bound by such overhead).
EXACT_INLINE = dict(EXACT, inline="always")


def njit_serial(fn):
    return numba.njit(**SERIAL)(fn)


def njit_parallel(fn):
    return numba.njit(**PARALLEL)(fn)


def njit_exact(fn):
    return numba.njit(**EXACT)(fn)


def njit_exact_inline(fn):
    return numba.njit(**EXACT_INLINE)(fn)


def njit_exact_parallel(fn):
    return numba.njit(**EXACT, parallel=True)(fn)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(n: int | None = None) -> int:
    """Threads for numba kernels and torch ops alike (default: all available cores); returns n."""
    n = available_cores() if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"n={n!r}: expected an int in 1..{numba.config.NUMBA_NUM_THREADS}")
    numba.set_num_threads(n)
    torch.set_num_threads(n)
    return n


# numba sizes its pool by os.cpu_count(), which counts cores this process may not run on (containers,
# taskset): start at the cores it may use. torch's own count is left as the user or torch chose.
numba.set_num_threads(min(numba.config.NUMBA_NUM_THREADS, available_cores()))


@functools.cache  # asking LLVM for the host's features takes ~0.2 ms, and they never change
def target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with this LLVM feature ("avx2", ...): NUMBA_CPU_FEATURES if
    the user (or _allow_512_bit_vectors) set it, else the host's, unless another CPU was named."""
    if numba.config.CPU_FEATURES is not None:
        return f"+{feature}" in numba.config.CPU_FEATURES.split(",")
    if numba.config.CPU_NAME not in (None, "host"):  # compiling for a named (generic) CPU: assume not
        return False
    return bool(llvm.get_host_cpu_features().get(feature))
