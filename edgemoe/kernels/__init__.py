"""edgemoe.kernels: numba CPU kernels on packed INT2/4/8 weights (edgemoe.quant).

    qmatmul(x, qt)                       # float32 [T, C] -> [T, R], y = x @ W^T, small T
    dequantize(qt, dtype)                # torch float32 / bfloat16 [R, C], for large T via torch
    swiglu_expert(x, gate, up, down)     # fused SwiGLU expert, float32 [T, D] -> [T, D]
    qmatmul_int(x, qt), swiglu_expert_int(x, gate, up, down)   # the same on int8 activations
    int_paths(), default_int_path()      # integer code paths this CPU runs ("avx2", "portable")
    set_threads(n)                       # numba and torch thread counts together

Experts other than SwiGLU (ModelSpec.expert_activation): edgemoe.kernels.activations, one function per
kind over a matmul the caller supplies (these kernels, or torch).
Plain torch twins of each kernel: edgemoe.kernels.reference. Integer path: edgemoe/kernels/cpu_int.py. numba options: edgemoe.kernels._jit.
"""

from ._jit import set_threads
from .ops import (default_int_path, dequantize, int_paths, qmatmul, qmatmul_int, swiglu_expert,
                  swiglu_expert_int)

__all__ = ["default_int_path", "dequantize", "int_paths", "qmatmul", "qmatmul_int", "set_threads",
           "swiglu_expert", "swiglu_expert_int"]
