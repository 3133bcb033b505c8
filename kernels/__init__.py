"""edgemoe.kernels: numba CPU kernels on packed INT2/4/8 weights (edgemoe.quant).

    qmatmul(x, qt)                       # float32 [T, C] -> [T, R], y = x @ W^T, small T
    dequantize(qt, dtype)                # torch float32 / bfloat16 [R, C], for large T via torch
    swiglu_expert(x, gate, up, down)     # fused SwiGLU expert, float32 [T, D] -> [T, D]
    set_threads(n)                       # numba and torch thread counts together

Plain torch twins of each kernel: edgemoe.kernels.reference. numba options: edgemoe.kernels._jit.
"""

from ._jit import set_threads
from .ops import dequantize, qmatmul, swiglu_expert

__all__ = ["dequantize", "qmatmul", "set_threads", "swiglu_expert"]
