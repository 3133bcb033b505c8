"""Experts served by a tiered store and computed from their quantized weights.

Where an expert computes (its token count S decides, never its residency in RAM):
- in RAM, S <= fused_max_tokens: the fused numba SwiGLU kernel on the packed weights;
- in RAM, larger S: dequantize once (numba) and multiply with torch;
- in VRAM (a torch device): dequantize there and multiply there.
The issue-6 latency model replaces fused_max_tokens by a measured per-machine decision.

Shapes: T tokens, D hidden, S tokens of one expert.
"""

from __future__ import annotations

import torch

from edgemoe import kernels
from edgemoe.store import ResidentExpert, TieredStore

from .experts import ExpertBatches, ExpertProvider
from .layers import swiglu

FUSED_MAX_TOKENS = 16  # the fused kernel's design range (issue 4); a kernel limit, not a latency model


class QuantizedExpert:
    def __init__(self, resident: ResidentExpert, fused_max_tokens: int = FUSED_MAX_TOKENS):
        self.resident = resident
        self.fused_max_tokens = fused_max_tokens
        self.nbytes = resident.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        r = self.resident
        if r.device is not None:
            w = r.dequantize(torch.float32)
            return swiglu(x.to(r.device, torch.float32), w["gate"], w["up"], w["down"]).to(x.device, x.dtype)
        if x.shape[0] <= self.fused_max_tokens:
            t = r.tensors
            y = kernels.swiglu_expert(x.float().contiguous().numpy(), t["gate"], t["up"], t["down"])
            return torch.from_numpy(y).to(x.dtype)
        w = {role: kernels.dequantize(qt) for role, qt in r.tensors.items()}
        return swiglu(x.float(), w["gate"], w["up"], w["down"]).to(x.dtype)


class StoreExperts(ExpertProvider):
    """The ExpertProvider of a model loaded from a store."""

    def __init__(self, store: TieredStore, fused_max_tokens: int = FUSED_MAX_TOKENS):
        self.store = store
        self.fused_max_tokens = fused_max_tokens

    def expert(self, layer: int, expert: int) -> QuantizedExpert:
        return QuantizedExpert(self.store.get(layer, expert), self.fused_max_tokens)

    def run(self, layer: int, x: torch.Tensor, batches: ExpertBatches) -> torch.Tensor:
        self.store.begin_layer(layer)
        # The loader reads the layer's other experts while the first ones compute.
        self.store.prefetch((layer, e) for e in batches.experts[1:])
        return super().run(layer, x, batches)
