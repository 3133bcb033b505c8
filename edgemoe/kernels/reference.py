"""Plain torch twins of the numba kernels: what each kernel must compute, used by the parity tests.

Shapes: T tokens, R rows, C columns, D hidden, I expert hidden.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from edgemoe.quant import QuantizedTensor, dequantize_reference, get_format


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


def relu_expert_reference(x: np.ndarray, up: QuantizedTensor, down: QuantizedTensor) -> np.ndarray:
    """down(relu(up x)) on the dequantized weights: x float32 [T, D] -> float32 [T, D]."""
    h = torch.relu(F.linear(torch.from_numpy(x), dequantize_reference(up)))  # [T, I]
    return F.linear(h, dequantize_reference(down)).numpy()


def relu_int_twin(x: np.ndarray, up: QuantizedTensor, down: QuantizedTensor) -> np.ndarray:
    """down(relu(up x)) through the integer path's products, bit for bit: x float32 [T, D] -> [T, D]."""
    return _int_linear(torch.relu(_int_linear(torch.from_numpy(x), up)), down).numpy()


def quantize_activations_reference(x: torch.Tensor, group: int, ngroups: int):
    """x float32 [T, C] -> xq int8 [T, Cp], xs float32 [T, NG], qs int64 [T, NG] (edgemoe/kernels/cpu_int.py's rule):
    per token and group, xs = max|x| / 127, xq = round half to even of x / xs, 0 where xs = 0."""
    ntok, cols = x.shape
    xg = F.pad(x, (0, ngroups * group - cols)).reshape(ntok, ngroups, group)  # [T, NG, G]
    xs = xg.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(xs > 0, torch.round(xg / xs).clamp(-127, 127), 0).to(torch.int8)
    return xq.reshape(ntok, -1), xs.squeeze(-1), xq.sum(-1, dtype=torch.int64)


def _int_linear(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """The integer path's x @ W^T: float32 [T, C] -> [T, R], the epilogue in the kernel's order."""
    xq, xs, qs = quantize_activations_reference(x, qt.group, qt.ngroups)
    codes = get_format(qt.bits).unpack(torch.tensor(qt.packed), qt.group).long()  # [R, NG, G]
    scale, zero = torch.tensor(qt.scale), torch.tensor(qt.zero)  # [R, NG]
    if uses_lanes(qt):
        return _lane_rule(codes, xq.reshape(x.shape[0], qt.ngroups, qt.group), xs, qs, scale, zero, qt.bits)
    isum = torch.einsum("rgk,tgk->trg", codes, xq.long().reshape(x.shape[0], qt.ngroups, qt.group))
    terms = (scale * xs[:, None, :]) * (isum.float() - zero * qs.float()[:, None, :])  # [T, R, NG]
    y = torch.zeros(x.shape[0], qt.shape[0])
    for g in range(qt.ngroups):  # the kernel adds groups one by one, in order
        y = y + terms[:, :, g]
    return y


def uses_lanes(qt: QuantizedTensor) -> bool:
    """Whether the integer kernels multiply qt by the lane rule (edgemoe/kernels/cpu_int.py)."""
    return qt.ngroups > 1 and (qt.group * qt.bits // 8) % 32 == 0


def _lane_rule(codes, xq, xs, qs, scale, zero, bits):
    """codes [R, NG, G], xq [T, NG, G]: the lane rule's result [T, R], in the kernels' order."""
    group = codes.shape[-1]
    plane = group * bits // 8
    lane_of = torch.arange(group) % plane % 32 // 4        # code c sits in byte c % P of its group
    one_hot = F.one_hot(lane_of, 8).long()                # [G, 8]
    lanes = torch.einsum("rgk,tgk,kl->trgl", codes, xq.long(), one_hot).float()   # exact integer sums
    s = scale * xs[:, None, :]                             # [T, R, NG]
    acc = torch.zeros(*s.shape[:2], 8)
    for g in range(codes.shape[1]):
        acc = acc + lanes[:, :, g] * s[:, :, g, None]
    total = acc[..., 0]
    for lane in range(1, 8):
        total = total + acc[..., lane]
    offset = torch.zeros_like(total)
    for g in range(codes.shape[1]):
        offset = offset + s[:, :, g] * zero[None, :, g] * qs[:, None, g].float()
    return total - offset


def qmatmul_int_twin(x: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """qmatmul_int's result, bit for bit: x float32 [T, C] -> float32 [T, R]."""
    return _int_linear(torch.from_numpy(x), qt).numpy()


def silu_mul_twin(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u as edgemoe/kernels/cpu_int.py computes it: exp in float64, rounded to float32."""
    return g / (1 + torch.exp((-g).double()).float()) * u


def swiglu_int_twin(x: np.ndarray, gate: QuantizedTensor, up: QuantizedTensor,
                    down: QuantizedTensor) -> np.ndarray:
    """swiglu_expert_int's result: x float32 [T, D] -> float32 [T, D]."""
    xt = torch.from_numpy(x)
    h = silu_mul_twin(_int_linear(xt, gate), _int_linear(xt, up))  # [T, I]
    return _int_linear(h, down).numpy()


def gpt_oss_reference(x: np.ndarray, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor,
                      gate_bias: torch.Tensor, up_bias: torch.Tensor, down_bias: torch.Tensor,
                      alpha: float, limit: float) -> np.ndarray:
    """GPT-OSS's expert written out on the dequantized weights, as transformers writes it (gate and up
    as one interleaved projection): x float32 [T, D] -> float32 [T, D]."""
    w_gate, w_up = dequantize_reference(gate), dequantize_reference(up)
    gate_up_t = torch.stack((w_gate, w_up), dim=1).reshape(-1, w_gate.shape[1]).T          # [D, 2I] interleaved
    gate_up_bias = torch.stack((gate_bias, up_bias), dim=1).reshape(-1)
    h = torch.from_numpy(x) @ gate_up_t + gate_up_bias
    g, u = h[..., ::2].clamp(min=None, max=limit), h[..., 1::2].clamp(min=-limit, max=limit)
    glu = g * torch.sigmoid(g * alpha)
    return ((u + 1) * glu @ dequantize_reference(down).T + down_bias).numpy()
