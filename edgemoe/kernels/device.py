"""Experts computed on a torch device (a GPU; the CPU stands in for it in tests): an expert's packed
arrays are copied there, dequantized there (edgemoe.quant.dequantize_arrays) and multiplied in
float32. Tested with the CPU as a stand-in device everywhere, and on a CUDA GPU where torch sees one
(tests/conftest.py's vram_device; tools/check_gpu.sh).

meta: role -> {"shape", "bits", "group_size"}, as in the store's manifest (expert_meta builds it).
Shapes: S tokens, D hidden, K experts.

On a GPU a small expert's call costs its torch launches (about thirty: unpack, convert, scale each
matrix, three products), not its bytes. So a layer's experts of one shape and width are dequantized
together (swiglu_batch_on_device): each matrix's rows are quantized on their own, so the experts'
packed rows stacked are one packed matrix of K x R rows, dequantized by one set of launches.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from edgemoe.quant import ARRAY_DTYPES, QuantizedTensor, dequantize_arrays, group_layout

# The float32 weights one batch of experts may hold on the device at once: the fine-grained experts
# this pays for (a few MB each) batch by the dozen, while a large one (Mixtral-8x7B's: 704 MB, whose
# products outweigh its launches) goes alone, and a batch stays a small share of a Jetson's memory.
DEVICE_BATCH_BYTES = 256 << 20


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


def batch_key(meta: dict[str, dict]) -> tuple:
    """What experts must share to be dequantized together: every matrix's shape, width and groups."""
    return tuple(sorted((role, tuple(m["shape"]), m["bits"], m["group_size"]) for role, m in meta.items()))


def float_bytes(meta: dict[str, dict]) -> int:
    """The expert's matrices dequantized to float32, in bytes: what a batch holds on the device while
    it computes."""
    return sum(4 * m["shape"][0] * m["shape"][1] for m in meta.values())


def swiglu_batch_on_device(x: torch.Tensor, counts: list[int], meta: dict[str, dict],
                           arrays: list[dict[str, dict[str, torch.Tensor]]]) -> torch.Tensor:
    """K SwiGLU experts of one batch_key on their tokens, x [S, D] float32 (expert k's counts[k] rows
    in turn), on the device holding x and `arrays`: each matrix of the K experts dequantized in one
    go, then one batched product per matrix when every expert has as many tokens (a decode step),
    else one product per expert. -> [S, D], left on the device. The weights are those of
    swiglu_on_device; the products may sum in another order (float32 rounding)."""
    k = len(arrays)
    w = {}
    for role, m in meta.items():
        rows, cols = m["shape"]
        stacked = {name: torch.cat([a[role][name] for a in arrays]) for name in ARRAY_DTYPES}
        w[role] = dequantize_on_device({**m, "shape": [k * rows, cols]}, stacked).reshape(k, rows, cols)
    if len(set(counts)) == 1:
        xb = x.reshape(k, counts[0], -1)
        h = F.silu(torch.bmm(xb, w["gate"].transpose(1, 2))) * torch.bmm(xb, w["up"].transpose(1, 2))
        return torch.bmm(h, w["down"].transpose(1, 2)).reshape(x.shape[0], -1)
    out, at = [], 0
    for j, count in enumerate(counts):
        xj = x[at:at + count]
        out.append(F.linear(F.silu(F.linear(xj, w["gate"][j])) * F.linear(xj, w["up"][j]), w["down"][j]))
        at += count
    return torch.cat(out)


def swiglu_on_device(x: torch.Tensor, meta: dict[str, dict], on_device: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """The expert on x [S, D] float32, on the device holding x and `on_device`, dequantized and
    multiplied there; the result stays there (a caller collects a layer's experts before the one copy
    back that waits for them)."""
    w = weights_on_device(meta, on_device)
    return F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])
