"""Plain torch twins of the numba kernels: what each kernel must compute, used by the parity tests.

Shapes: T tokens, R rows, C columns, D hidden, I expert hidden.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from edgemoe.quant import QuantizedTensor, dequantize_reference


def qmatmul_reference(x: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """x float32 [T, C] @ W^T -> float32 [T, R]."""
    return F.linear(torch.from_numpy(x), dequantize_reference(qt)).numpy()


def dequantize_twin(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_reference(qt).to(dtype)


def swiglu_reference(x: np.ndarray, gate: QuantizedTensor, up: QuantizedTensor,
                     down: QuantizedTensor) -> np.ndarray:
    """down(silu(gate x) * (up x)): x float32 [T, D] -> float32 [T, D]."""
    xt = torch.from_numpy(x)
    h = F.silu(F.linear(xt, dequantize_reference(gate))) * F.linear(xt, dequantize_reference(up))  # [T, I]
    return F.linear(h, dequantize_reference(down)).numpy()
