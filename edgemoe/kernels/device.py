"""Experts computed on a torch device (a GPU; the CPU stands in for it in tests): an expert's packed
arrays are copied there, dequantized there (edgemoe.quant.dequantize_arrays) and multiplied in
float32. Tested with the CPU as a stand-in device everywhere, and on a CUDA GPU where torch sees one
(tests/conftest.py's vram_device; tools/check_gpu.sh).

meta: role -> {"shape", "bits", "group_size"}, as in the store's manifest (expert_meta builds it).
Shapes: S tokens, D hidden.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from edgemoe.quant import ARRAY_DTYPES, QuantizedTensor, dequantize_arrays, group_layout


def to_device(tensors: dict[str, QuantizedTensor], device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """An expert's packed arrays copied to a torch device: role -> packed/scale/zero."""
    return {role: {name: torch.from_numpy(np.array(getattr(qt, name))).to(device) for name in ARRAY_DTYPES}
            for role, qt in tensors.items()}


def to_host(meta: dict[str, dict], on_device: dict[str, dict[str, torch.Tensor]]) -> dict[str, QuantizedTensor]:
    """The inverse of to_device: QuantizedTensors in host memory."""
    out = {}
    for role, t in on_device.items():
        m = meta[role]
        arrays = {name: np.ascontiguousarray(t[name].cpu().numpy()).reshape(-1) for name in ARRAY_DTYPES}
        out[role] = QuantizedTensor.from_arrays(m["bits"], m["group_size"], tuple(m["shape"]), arrays)
    return out


def expert_meta(tensors: dict[str, QuantizedTensor]) -> dict[str, dict]:
    return {role: {"shape": list(qt.shape), "bits": qt.bits, "group_size": qt.group_size}
            for role, qt in tensors.items()}


def dequantize_on_device(meta: dict, arrays: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One weight [R, C] in `dtype`, on the device holding `arrays`."""
    rows, cols = meta["shape"]
    group, _ = group_layout(meta["bits"], meta["group_size"], cols)
    return dequantize_arrays(arrays, meta["bits"], group, (rows, cols)).to(dtype)


def weights_on_device(meta: dict[str, dict], on_device: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every matrix of an expert dequantized to float32 on the device holding it: role -> [R, C]."""
    return {role: dequantize_on_device(meta[role], t) for role, t in on_device.items()}


def swiglu_on_device(x: torch.Tensor, meta: dict[str, dict], on_device: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """The expert on x [S, D] float32, on the device holding x and `on_device`, dequantized and
    multiplied there; the result stays there (a caller collects a layer's experts before the one copy
    back that waits for them)."""
    w = weights_on_device(meta, on_device)
    return F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])
