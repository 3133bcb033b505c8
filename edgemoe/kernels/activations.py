"""Experts other than plain SwiGLU, one function per ModelSpec.expert_activation kind.

The fused numba kernels compute only SwiGLU. Every other kind computes through a `matmul(h, role)`
the caller supplies (h @ W_role^T, float32 torch [S, C] -> [S, R]): the per-matrix quantized kernels
(qmatmul, qmatmul_int), torch on dequantized weights, or torch on a device; the activation and
biases are applied here, between the matmuls, the same way for every path.

Shapes: S tokens of one expert, D hidden, I expert hidden.
"""

from __future__ import annotations

from typing import Callable

import torch

Matmul = Callable[[torch.Tensor, str], torch.Tensor]


def gpt_oss_expert(x: torch.Tensor, matmul: Matmul, gate_bias: torch.Tensor, up_bias: torch.Tensor,
                   down_bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert: x float32 [S, D] -> [S, D]. gate_bias, up_bias [I], down_bias [D].

    gate = (gate x + b).clamp(max=limit), up = (up x + b).clamp(-limit, limit),
    out = down((up + 1) * gate * sigmoid(alpha * gate)) + b_down.
    """
    gate = (matmul(x, "gate") + gate_bias.to(x.device)).clamp(max=limit)
    up = (matmul(x, "up") + up_bias.to(x.device)).clamp(-limit, limit)
    hidden = (up + 1) * (gate * torch.sigmoid(alpha * gate))     # [S, I]
    return matmul(hidden, "down") + down_bias.to(x.device)


def relu_expert(x: torch.Tensor, matmul: Matmul) -> torch.Tensor:
    """Switch Transformers' ungated expert, down(relu(up x)): x float32 [S, D] -> [S, D] (no gate role)."""
    return matmul(matmul(x, "up").clamp(min=0), "down")
