"""Experts of the kinds other than SwiGLU (ModelSpec.expert_activation), one function per kind.

The fused numba kernels are SwiGLU's alone. These kinds compute through one matrix product at a time,
given as `matmul(x, w) -> x @ w^T`: the quantized per-matrix kernels (qmatmul, qmatmul_int) on packed
weights, or torch's linear on dequantized ones (the dequant and device paths), so every path applies
the same function. x and the weights are numpy arrays or torch tensors, as `matmul` takes them.

Shapes: T tokens, D hidden, I expert hidden.
"""

from __future__ import annotations

from typing import Callable


def relu_expert(x, weights: dict, matmul: Callable):
    """Switch Transformers' ungated expert down(relu(up x)): x [T, D], weights {"up" [I, D], "down" [D, I]}
    -> [T, D]."""
    return matmul(matmul(x, weights["up"]).clip(min=0), weights["down"])
