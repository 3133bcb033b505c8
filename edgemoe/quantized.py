"""Experts served by a tiered store and computed from their quantized weights.

Where an expert in RAM computes is decided by its width and token count S alone (so that tiering
never changes results): "fused", the numba SwiGLU kernel on the packed weights, or "dequant",
dequantize once (numba) then torch matmuls. `compute="auto"` picks the cheaper by this machine's
measured latency model (edgemoe.latency); "fused" or "dequant" force one. An expert resident on a
torch device (the VRAM tier) is dequantized and multiplied there.

Shapes: T tokens, D hidden, S tokens of one expert.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from edgemoe import kernels
from edgemoe.store import ResidentExpert, TieredStore

from .experts import ExpertBatches, ExpertProvider
from .layers import swiglu

COMPUTE_CHOICES = ("auto", "fused", "dequant")


class QuantizedExpert:
    def __init__(self, resident: ResidentExpert, choose: Callable[[int, int], str]):
        self.resident = resident
        self.choose = choose          # (bits, tokens) -> "fused" | "dequant"
        self.nbytes = resident.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        r = self.resident
        if r.device is not None:
            w = r.dequantize(torch.float32)
            return swiglu(x.to(r.device, torch.float32), w["gate"], w["up"], w["down"]).to(x.device, x.dtype)
        if self.choose(r.bits, x.shape[0]) == "fused":
            t = r.tensors
            y = kernels.swiglu_expert(x.float().contiguous().numpy(), t["gate"], t["up"], t["down"])
            return torch.from_numpy(y).to(x.dtype)
        w = {role: kernels.dequantize(qt) for role, qt in r.tensors.items()}
        return swiglu(x.float(), w["gate"], w["up"], w["down"]).to(x.dtype)


class StoreExperts(ExpertProvider):
    """The ExpertProvider of a model loaded from a store."""

    def __init__(self, store: TieredStore, compute: str = "auto", overlap: bool = True):
        if compute not in COMPUTE_CHOICES:
            raise ValueError(f"compute={compute!r}: expected one of {COMPUTE_CHOICES}")
        self.store = store
        self.compute = compute
        self.overlap = overlap       # read a layer's other experts in the background while one computes
        self._latency = None
        self.io_wait_seconds = 0.0   # time the compute spent waiting for experts to arrive

    @property
    def latency(self):
        """This machine's latency model for the store's expert shape (calibrated once, then cached)."""
        if self._latency is None:
            from .latency import load_or_calibrate
            spec = self.store.spec
            widths = {e.bits for e in self.store.manifest.experts.values()}
            self._latency = load_or_calibrate((spec.expert_hidden, spec.hidden_size), widths)
        return self._latency

    def choose(self, bits: int, tokens: int) -> str:
        return self.compute if self.compute != "auto" else self.latency.choose(bits, tokens)

    def expert(self, layer: int, expert: int) -> QuantizedExpert:
        start = time.perf_counter()
        resident = self.store.get(layer, expert)
        self.io_wait_seconds += time.perf_counter() - start
        return QuantizedExpert(resident, self.choose)

    def prepare(self, layer: int, batches: ExpertBatches) -> None:
        self.store.begin_layer(layer, needed=((layer, e) for e in batches.experts))

    def run(self, layer: int, x: torch.Tensor, batches: ExpertBatches) -> torch.Tensor:
        if self.overlap:
            self.store.prefetch(((layer, e) for e in batches.experts[1:]), urgent=True)
        return super().run(layer, x, batches)
