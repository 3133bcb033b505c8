"""The kernels' Python entry points: argument checks, zero-padding of activations, output buffers.

Shapes: T tokens, R rows, C columns, NG groups, G padded group size, Cp = NG * G, D hidden,
I expert hidden. Activations are numpy float32 [T, C], C-contiguous; outputs are new arrays.
"""

from __future__ import annotations

import numpy as np
import torch

from edgemoe.quant import QuantizedTensor

from . import cpu


def _check_qt(name: str, qt) -> QuantizedTensor:
    if not isinstance(qt, QuantizedTensor):
        raise ValueError(f"{name}: expected a QuantizedTensor, got {type(qt).__name__}")
    return qt


def _check_x(name: str, x, cols: int) -> np.ndarray:
    if (not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != cols
            or not x.flags.c_contiguous):
        desc = (f"{x.dtype} {x.shape} c_contiguous={x.flags.c_contiguous}" if isinstance(x, np.ndarray)
                else type(x).__name__)
        raise ValueError(f"{name}: expected a C-contiguous numpy float32 array [T, {cols}], got {desc}")
    return x


def _padded(x: np.ndarray, qt: QuantizedTensor) -> tuple[np.ndarray, np.ndarray]:
    """x [T, C] -> (zero-padded copy [T, Cp], per-group sums [T, NG])."""
    ntok = x.shape[0]
    xp = np.zeros((ntok, qt.ngroups * qt.group), np.float32)
    xp[:, : x.shape[1]] = x
    return xp, xp.reshape(ntok, qt.ngroups, qt.group).sum(axis=2)


def qmatmul(x: np.ndarray, qt: QuantizedTensor) -> np.ndarray:
    """y = x @ W^T from packed codes: x float32 [T, C] -> float32 [T, R]."""
    _check_qt("qt", qt)
    xp, xsum = _padded(_check_x("x", x, qt.shape[1]), qt)
    out = np.empty((x.shape[0], qt.shape[0]), np.float32)
    cpu.qmatmul_kernel(qt.bits, qt.group, qt.packed, qt.scale, qt.zero, xp, xsum, out, cpu.row_blocks())
    return out


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight [R, C] as float32 or bfloat16, bit-identical to dequantize_reference(qt).to(dtype)."""
    _check_qt("qt", qt)
    args = (qt.bits, qt.group, qt.packed, qt.scale, qt.zero)
    if dtype == torch.float32:
        out = np.empty(qt.shape, np.float32)
        cpu.dequantize_f32_kernel(*args, out)
        return torch.from_numpy(out)
    if dtype == torch.bfloat16:
        out = np.empty(qt.shape, np.uint16)
        cpu.dequantize_bf16_kernel(*args, out, cpu.row_blocks())
        return torch.from_numpy(out).view(torch.bfloat16)
    raise ValueError(f"dtype={dtype}: expected torch.float32 or torch.bfloat16")


def swiglu_expert(x: np.ndarray, gate: QuantizedTensor, up: QuantizedTensor,
                  down: QuantizedTensor) -> np.ndarray:
    """down(silu(gate x) * (up x)) in one parallel kernel: x float32 [T, D] -> float32 [T, D].

    gate, up: [I, D] with the same bits and group_size (decoded side by side); down: [D, I], any.
    """
    for name, qt in (("gate", gate), ("up", up), ("down", down)):
        _check_qt(name, qt)
    inner, dim = gate.shape
    if up.shape != (inner, dim) or down.shape != (dim, inner):
        raise ValueError(f"gate {gate.shape}, up {up.shape}, down {down.shape}: expected [I, D], [I, D], [D, I]")
    if (up.bits, up.group_size) != (gate.bits, gate.group_size):
        raise ValueError(f"up: bits={up.bits}, group_size={up.group_size} must match gate's "
                         f"({gate.bits}, {gate.group_size})")
    xp, xsum = _padded(_check_x("x", x, dim), gate)
    ntok = x.shape[0]
    hg, hu = np.empty((ntok, inner), np.float32), np.empty((ntok, inner), np.float32)
    h = np.zeros((ntok, down.ngroups * down.group), np.float32)  # padded input of down
    hsum = np.empty((ntok, down.ngroups), np.float32)
    out = np.empty((ntok, dim), np.float32)
    cpu.swiglu_kernel(gate.bits, gate.group, gate.packed, gate.scale, gate.zero,
                      up.packed, up.scale, up.zero, xp, xsum,
                      down.bits, down.group, down.packed, down.scale, down.zero, hg, hu, h, hsum, out,
                      cpu.row_blocks())
    return out
