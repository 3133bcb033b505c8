"""Experts served by a tiered store and computed from their quantized weights.

Where an expert in RAM computes is decided by its width and token count S alone (so that tiering
never changes results): "fused-int", the numba SwiGLU kernel on the packed weights with activations
quantized to int8 and integer dot products (edgemoe.kernels.swiglu_expert_int), "fused-float", the
same with float32 activations (swiglu_expert), "dequant", dequantize once (numba) then torch
matmuls, or, with a VRAM tier, "device": copy the packed bytes to the device and compute there. An
expert other than SwiGLU (ModelSpec.expert_activation: GPT-OSS's, Switch's ungated relu;
edgemoe/kernels/activations.py) has no fused kernel: on "fused-int" / "fused-float" it runs the
per-matrix kernels (qmatmul_int / qmatmul) with its activation and biases between them, except that
StoreExperts computes a layer's GPT-OSS experts on "fused-int" in the layer kernel, as SwiGLU's
(its gated unit in numba: the last bits of the sigmoid differ from torch's). `compute="auto"` picks the cheapest by this machine's measured
latency model (edgemoe.latency); the others force one. An expert resident on the device (the VRAM
tier) is dequantized and multiplied there.

Shapes: T tokens, D hidden, S tokens of one expert.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from edgemoe import kernels
from edgemoe.kernels.cpu_int import G_BITS
from edgemoe.kernels.ops import gpt_oss_arrays, gpt_oss_layout, swiglu_experts_int, weighted_sum
from edgemoe.store import ResidentExpert, TieredStore
from edgemoe.kernels.device import (DEVICE_BATCH_BYTES, batch_key, float_bytes, swiglu_batch_on_device,
                                    swiglu_on_device, to_device, weights_on_device)

from .experts import (Activation, ExpertBatches, ExpertProvider, dense_matmul, layer_kernel_arguments,
                      layer_kernel_kind)
from .layers import swiglu
from .options import OptionError

COMPUTE_CHOICES = ("auto", "fused-int", "fused-float", "dequant", "device")
FUSED = {"fused-int": kernels.swiglu_expert_int, "fused-float": kernels.swiglu_expert}
PER_MATRIX = {"fused-int": kernels.qmatmul_int, "fused-float": kernels.qmatmul}   # for a non-SwiGLU Activation


class QuantizedExpert:
    def __init__(self, resident: ResidentExpert, choose: Callable[[int, int, int], str],
                 device: torch.device | None = None, activation: Activation = None,
                 gemm_dtype: torch.dtype = torch.float32):
        self.resident = resident
        self.choose = choose          # (bits, tokens, nbytes) -> a COMPUTE_CHOICES entry but "auto"
        self.device = device          # the VRAM tier's device, for the "device" path
        self.activation = activation  # None: SwiGLU
        self.gemm_dtype = gemm_dtype  # what "dequant" dequantizes to and multiplies in (StoreExperts)
        self.nbytes = resident.nbytes
        self._dequantized: dict[str, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_device(x.shape[0]):
            return self.compute_on_device(x.to(self.where_on_device(), torch.float32)).to(x.device, x.dtype)
        if self.activation is not None:
            return self._activation(x)
        r = self.resident
        path = self.choose(r.bits, x.shape[0], r.nbytes)
        if path in FUSED:
            t = r.tensors
            y = FUSED[path](x.float().contiguous().numpy(), t["gate"], t["up"], t["down"])
            return torch.from_numpy(y).to(x.dtype)
        w = self._dequantize()
        return swiglu(x.float(), w["gate"], w["up"], w["down"]).to(x.dtype)

    def _dequantize(self) -> dict[str, torch.Tensor]:
        """The matrices dequantized to gemm_dtype, made once for every call on this object (a step's
        groups of the expert's tokens: ExpertBatches.path_groups)."""
        if self._dequantized is None:
            self._dequantized = {role: kernels.dequantize(qt, self.gemm_dtype) for role, qt in self.resident.tensors.items()}
        return self._dequantized

    def on_device(self, tokens: int) -> bool:
        """Whether this many tokens compute on the device: the expert is resident there, or the path
        chosen for this RAM expert is "device" (copy its packed bytes over: Fiddler)."""
        r = self.resident
        return r.device is not None or self.choose(r.bits, tokens, r.nbytes) == "device"

    def where_on_device(self) -> torch.device:
        return self.resident.device if self.resident.device is not None else self.device

    def compute_on_device(self, x: torch.Tensor) -> torch.Tensor:
        """The expert on x [S, D] float32, already on the device; the result stays there (queued work:
        nothing here waits for the device)."""
        arrays, meta = self.device_arrays(), self.resident.entry.tensors
        if self.activation is None:
            return swiglu_on_device(x, meta, arrays)
        return self.activation(x, dense_matmul(weights_on_device(meta, arrays)))

    def device_arrays(self) -> dict[str, dict[str, torch.Tensor]]:
        """The packed arrays on the device: the VRAM tier's, or a RAM expert's copied over now."""
        r = self.resident
        return r.device_tensors if r.device is not None else to_device(r.tensors, self.device)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """A non-SwiGLU expert on the host: its Activation over the path's matmuls. "fused-int" /
        "fused-float" run the per-matrix kernels (qmatmul_int / qmatmul), "dequant" torch on the
        dequantized weights."""
        r = self.resident
        path = self.choose(r.bits, x.shape[0], r.nbytes)
        if path in PER_MATRIX:
            def matmul(h: torch.Tensor, role: str) -> torch.Tensor:
                return torch.from_numpy(PER_MATRIX[path](h.contiguous().numpy(), r.tensors[role]))
        else:
            matmul = dense_matmul(self._dequantize())
        return self.activation(x.float(), matmul).to(x.dtype)


def latency_model(store: TieredStore, gemm_dtype: torch.dtype = torch.float32):
    """This machine's latency model (edgemoe.latency) for the store's expert shape, widths (fallback
    copies included), device and "dequant" GEMM type: from the cache, else calibrated now (a
    benchmark of seconds) and cached. The loader asks for it at load when compute is "auto", so no
    step pays for it."""
    from .latency import load_or_calibrate
    spec = store.spec
    widths = {e.bits for e in store.manifest.experts.values()} | {e.bits for e in store.manifest.fallback.values()}
    device = str(store.device) if store.device is not None else None
    return load_or_calibrate((spec.expert_hidden, spec.hidden_size), widths, device=device, gemm_dtype=gemm_dtype)


class StoreExperts(ExpertProvider):
    """The ExpertProvider of a model loaded from a store."""

    def __init__(self, store: TieredStore, compute: str = "auto", overlap: bool = True, skip_below: float = 0.0,
                 activations: Callable[[int, int], Activation] | None = None, fallback_below: float = 0.0,
                 layer_kernel: bool = True, latency=None, gemm_dtype: torch.dtype = torch.float32,
                 device_batch_bytes: int = DEVICE_BATCH_BYTES):
        """activations: (layer, expert) -> the expert's Activation (edgemoe.experts.expert_activations),
        None for SwiGLU experts. skip_below, fallback_below: see edgemoe.loader.StoreOptions.
        latency: the LatencyModel compute="auto" chooses by (latency_model(store); required then).
        layer_kernel: the experts of a layer that compute on "fused-int" go through one kernel call
        (swiglu_experts_int) rather than one call each; results are the same bits either way.
        gemm_dtype: the "dequant" path's matrices and GEMM (float32 accumulation either way):
        bfloat16 for a bfloat16 model on a CPU that multiplies it natively (the loader's choice, as
        for the dense matrices), 2-4x float32's speed on a prefill's expert batches
        (docs/benchmarks.md), else float32.
        device_batch_bytes: a layer's SwiGLU experts on the device that share their shapes and widths
        are dequantized together, up to this many bytes of float32 weights at once (0: one at a time,
        as before batching; docs/benchmarks.md "On a GPU" measures both)."""
        if compute == "device" and store.device is None:
            raise OptionError("compute=", compute, "needs a VRAM tier (a capacity for vram and its device)")
        self.store = store
        self.activations = activations or (lambda layer, expert: None)
        if compute == "auto" and latency is None:
            raise ValueError("StoreExperts: compute='auto' chooses by a latency model: "
                             "pass latency=latency_model(store)")
        self.compute = compute
        self.latency = latency       # what compute="auto" chooses by (None when a path is forced)
        self.overlap = overlap       # read a layer's other experts in the background while one computes
        self._choices: dict[tuple[int, int, int], str] = {}
        self.io_wait_seconds = 0.0   # time the compute spent waiting for experts to arrive
        self.skip_below = skip_below  # adaptive top-k: drop non-resident experts only weakly chosen
        self.skipped = 0              # (token, expert) pairs dropped so far
        self.fallback_below = fallback_below   # a weakly chosen expert may be served by its fallback copy
        self.fallback_uses = 0        # expert uses served by a fallback copy so far
        self._kept: ExpertBatches | None = None
        self._weak: set[tuple[int, int]] = set()   # the running layer's weakly chosen experts
        self.layer_kernel = layer_kernel
        # resident_step_layouts' last stacked table and its answer; resident_layouts' per layer
        self._checked_tables: tuple[np.ndarray, np.ndarray | None] | None = None
        self._kernel_tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._kinds: dict[int, str] = {}      # layer -> _kernel_kind's answer
        # (layer, expert) -> GPT-OSS's float32 arrays and its last layout row (from the store's row)
        self._kernel_arrays: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
        self._kernel_rows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.gemm_dtype = gemm_dtype
        self.device_batch_bytes = device_batch_bytes

    def choose(self, bits: int, tokens: int, nbytes: int = 0) -> str:
        """The path an expert of this width and size computes this many tokens on: self.compute, or
        the latency model's choice (made once per (bits, tokens, nbytes): a step asks per expert)."""
        if self.compute != "auto":
            return self.compute
        key = (bits, tokens, nbytes)
        if key not in self._choices:
            self._choices[key] = self.latency.choose(bits, tokens, nbytes)
        return self._choices[key]

    def expert(self, layer: int, expert: int) -> QuantizedExpert:
        return QuantizedExpert(self._fetch(layer, expert), self.choose, self.store.device,
                               self.activations(layer, expert), self.gemm_dtype)

    def float_weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The expert's stored codes dequantized (from the store's tiers, else the disk): WeightSource."""
        return self.store.get(layer, expert).dequantize()

    def activation(self, layer: int, expert: int) -> Activation:
        return self.activations(layer, expert)

    def _fetch(self, layer: int, expert: int) -> ResidentExpert:
        """The expert from the store, waiting for its read if need be (the wait counted)."""
        start = time.perf_counter()
        resident = self.store.get(layer, expert, fallback=(layer, expert) in self._weak)
        self.io_wait_seconds += time.perf_counter() - start
        self.fallback_uses += resident.narrowed
        return resident

    def prepare(self, layer: int, batches: ExpertBatches) -> None:
        self._kept = self._skip_weak_misses(layer, batches) if self.skip_below else batches
        self._weak = {(layer, e) for e in _weakly_chosen(self._kept, self.fallback_below)}
        self.store.begin_layer(layer, needed=((layer, e) for e in self._kept.experts), weak=self._weak)

    def run(self, layer: int, x: torch.Tensor, batches: ExpertBatches) -> torch.Tensor:
        batches = self._kept if self._kept is not None else batches
        self._kept = None
        if self.layer_kernel and x.dtype == torch.float32:
            return self._run_by_pairs(layer, x, batches)
        if self.overlap:
            self.store.prefetch(((layer, e) for e in batches.experts[1:]), urgent=True)
        return super().run(layer, x, batches)

    def _run_by_pairs(self, layer: int, x: torch.Tensor, batches: ExpertBatches) -> torch.Tensor:
        """ExpertProvider.run's result, bit for bit: each (token, expert) pair's output into y [P, D],
        then their weighted sum in expert order. The resident experts compute first, those on
        "fused-int" in one kernel call, while the missing ones load; then the missing ones."""
        out = self._run_resident(layer, x, batches)
        if out is not None:
            return out
        pair_x = x.numpy()[batches.pair_tokens.numpy()]                             # [P, D]
        y = np.empty(pair_x.shape, np.float32)
        weak = {e for _, e in self._weak} if self._weak else ()
        resident = self.store.get_resident(layer, batches.experts, weak)
        waiting = [i for i, r in enumerate(resident) if r is None]
        if self.overlap and waiting:   # read in the background while the resident ones compute
            self.store.prefetch(((layer, batches.experts[i]) for i in waiting), urgent=True)
        ready = [(i, r) for i, r in enumerate(resident) if r is not None]
        self.fallback_uses += sum(r.narrowed for _, r in ready)
        self._compute_pairs(layer, pair_x, batches, ready, y)
        if waiting:
            arrived = [(i, self._fetch(layer, batches.experts[i])) for i in waiting]
            self._compute_pairs(layer, pair_x, batches, arrived, y)
        return _weighted_sum(x, batches, y)

    def _run_resident(self, layer: int, x: torch.Tensor, batches: ExpertBatches) -> torch.Tensor | None:
        """_run_by_pairs for a layer of SwiGLU experts all resident in RAM at full width (the store's
        resident_layer_table) and each on "fused-int": their rows of the table, one kernel call, the
        weighted sum, and the requests counted in one call; no object per expert. None otherwise
        (then the general path runs)."""
        if self._weak or self.store.device is not None:
            return None
        table = self.store.resident_layer_table(layer)
        if table is None:
            return None
        rows = table[batches.experts]
        if any(self.choose(bits, count) != "fused-int" for bits, count in _path_widths(rows[:, G_BITS], batches)):
            return None
        layouts = self._kernel_layouts(layer, batches.experts, rows)
        if layouts is None:
            return None
        self.store.get_resident(layer, batches.experts)   # counted as get() counts them
        y = swiglu_experts_int(x.numpy()[batches.pair_tokens.numpy()], layouts, batches.starts)
        return _weighted_sum(x, batches, y)

    def _kernel_layouts(self, layer: int, experts, rows: np.ndarray) -> np.ndarray | None:
        """The experts' layout rows (the store's, one per expert) as the layer kernel computes them, or
        None where an expert is of a kind it does not compute."""
        kind = self._kernel_kind(layer)
        if kind != "gpt_oss":
            return rows if kind == "rows" else None
        return np.stack([self._kernel_row(layer, e, row) for e, row in zip(experts, rows)])

    def _kernel_kind(self, layer: int) -> str:
        """How the layer kernel computes the layer's experts (one kind for a whole model):
        edgemoe.experts.layer_kernel_kind. Asked once per layer: making an expert's Activation indexes
        its biases, a few torch calls each time."""
        kind = self._kinds.get(layer)
        if kind is None:
            kind = self._kinds[layer] = layer_kernel_kind(self.activations(layer, 0))
        return kind

    def _kernel_row(self, layer: int, expert: int, row: np.ndarray) -> np.ndarray | None:
        """One expert's layout row for the layer kernel: the store's row for SwiGLU and relu, with its
        biases and parameters for GPT-OSS (their arrays kept here while the model lives), None for
        another kind."""
        kind = self._kernel_kind(layer)
        if kind != "gpt_oss":
            return row if kind == "rows" else None
        key = (layer, expert)
        cached = self._kernel_rows.get(key)
        if cached is not None and np.array_equal(cached[0], row):
            return cached[1]
        if key not in self._kernel_arrays:
            self._kernel_arrays[key] = gpt_oss_arrays(**layer_kernel_arguments(self.activations(layer, expert)))
        kernel_row = gpt_oss_layout(row, self._kernel_arrays[key])
        self._kernel_rows[key] = (row.copy(), kernel_row)
        return kernel_row

    def resident_layouts(self, layer: int) -> np.ndarray | None:
        """The layer's experts as the decode engine computes them inside its own kernel (the store's
        resident_layer_table, each row as the layer kernel computes the expert), when every expert of
        the store is resident in RAM at full width, of a kind the layer kernel computes, and one token
        of each width computes on "fused-int"; else None."""
        table = self.store.resident_layer_table(layer) if self.layer_kernel else None
        if table is None or not self._engine_computes(table, [layer]):
            return None
        cached = self._kernel_tables.get(layer)
        if cached is None or cached[0] is not table:    # once per table the store makes
            self._kernel_tables[layer] = cached = (table, self._kernel_layouts(layer, range(len(table)), table))
        return cached[1]

    def resident_step_layouts(self, first: int = 0) -> np.ndarray | None:
        tables = self.store.resident_tables(first) if self.layer_kernel else None
        if tables is None:
            return None
        if self._checked_tables is None or self._checked_tables[0] is not tables:   # once per stacked table
            layers = range(first, first + tables.shape[0])
            kernel_tables = None
            if self._engine_computes(tables, layers):
                as_stored = all(self._kernel_kind(l) == "rows" for l in layers)
                kernel_tables = tables if as_stored else np.stack(
                    [self._kernel_layouts(l, range(tables.shape[1]), tables[l - first]) for l in layers])
            self._checked_tables = (tables, kernel_tables)
        return self._checked_tables[1]

    def _engine_computes(self, tables: np.ndarray, layers) -> bool:
        """Whether these layers' resident experts (their layout tables) compute in the decode engine's
        kernel: on the host, of a kind the layer kernel computes, one token of each of their widths on
        "fused-int"."""
        widths = set(tables[..., G_BITS].ravel().tolist())
        return (self.store.device is None and all(self._kernel_kind(l) != "none" for l in layers)
                and all(self.choose(bits, 1) == "fused-int" for bits in widths))

    def served_resident(self, first_layer: int, chosen: list[list[int]]) -> None:
        self.store.served_resident(first_layer, chosen)

    def _compute_pairs(self, layer: int, pair_x: np.ndarray, batches: ExpertBatches,
                       experts: list[tuple[int, ResidentExpert]], y: np.ndarray) -> None:
        """y's rows of the pairs of the experts (i, batches.experts[i] as resident), each of an expert's
        groups of pairs (ExpertBatches.path_groups) on the path chosen for its count; pair_x [P, D]:
        each pair's token. A group chosen as one token that does not go on "fused-int" computes a pair
        at a time (one row's bits)."""
        fused, layouts, on_device = [], [], []   # fused: pair ranges (an expert's all: a slice) or indices
        for i, resident in experts:
            start, end = int(batches.starts[i]), int(batches.starts[i + 1])
            groups = batches.path_groups(i) if batches.parts is not None else ((None, end - start),)
            # "fused-int" on the host (SwiGLU, GPT-OSS, relu): the layer kernel (for SwiGLU, that path's bits)
            rows = [self._fused_row(layer, batches.experts[i], resident, count) for _, count in groups]
            if all(row is not None for row in rows):   # one group, in order: the expert's weights read once
                fused.append(slice(start, end))
                layouts.append(rows[0])
                continue
            expert = QuantizedExpert(resident, self.choose, self.store.device,   # one for its groups: dequantized once
                                     self.activations(layer, batches.experts[i]), self.gemm_dtype)
            for (pairs, count), row in zip(groups, rows):
                pairs = np.arange(start, end) if pairs is None else pairs
                if row is not None:
                    fused.append(pairs)
                    layouts.append(row)
                    continue
                for group in (pairs.reshape(-1, 1) if count == 1 else [pairs]):
                    if expert.on_device(count):
                        on_device.append((group, expert))
                    else:
                        y[group] = expert(torch.from_numpy(pair_x[group])).numpy()
        if on_device:
            _compute_on_device(pair_x, on_device, y, self.device_batch_bytes)
        if not fused:
            return
        if len(fused) == len(batches.experts) and all(isinstance(f, slice) for f in fused):
            y[:] = swiglu_experts_int(pair_x, np.array(layouts), batches.starts)   # the whole layer, in order (the usual case)
            return
        pairs = np.concatenate([np.arange(f.start, f.stop) if isinstance(f, slice) else f for f in fused])
        sizes = np.cumsum([0] + [f.stop - f.start if isinstance(f, slice) else len(f) for f in fused])
        y[pairs] = swiglu_experts_int(pair_x[pairs], np.array(layouts), sizes)

    def _fused_row(self, layer: int, expert: int, resident: ResidentExpert, count: int) -> np.ndarray | None:
        """The expert's layout row for the layer kernel where this many of its tokens compute on
        "fused-int" on the host (and the kernel computes its kind), else None."""
        if (resident.device is None and self._kernel_kind(layer) != "none"
                and self.choose(resident.bits, count, resident.nbytes) == "fused-int"):
            return self._kernel_row(layer, expert, resident.layout)
        return None

    def _skip_weak_misses(self, layer: int, batches: ExpertBatches) -> ExpertBatches:
        """Adaptive top-k: an expert that is not resident and that every one of its tokens chose with
        a weight below skip_below (never as its strongest) is not read; each token's remaining
        weights are scaled to keep their sum. Results then depend on what is resident."""
        missing = {e for l, e in self.store.missing([(layer, e) for e in batches.experts])}
        skip = missing & _weakly_chosen(batches, self.skip_below)
        if not skip:
            return batches
        kept = [(e, t, w) for e, t, w in batches if e not in skip]
        self.skipped += sum(len(t) for e, t, _ in batches if e in skip)
        tokens = torch.cat(batches.tokens)
        count = int(tokens.max()) + 1
        total = torch.zeros(count).index_add_(0, tokens, torch.cat(batches.weights))
        remaining = torch.zeros(count).index_add_(0, torch.cat([t for _, t, _ in kept]),
                                                  torch.cat([w for _, _, w in kept]))
        scale = total / remaining
        return ExpertBatches.from_lists([e for e, _, _ in kept], [t for _, t, _ in kept], [w * scale[t] for _, t, w in kept])


def _compute_on_device(pair_x: np.ndarray, experts: list[tuple[np.ndarray, QuantizedExpert]], y: np.ndarray,
                       batch_bytes: int) -> None:
    """y's rows of the pairs (indices, with their expert) of a layer's experts that compute on the
    device: their rows copied over at once, every expert's work queued (those of one shape and width
    dequantized together: _device_batches), and one copy back, which waits for all of it (one wait a
    layer, not one an expert: on a GPU each wait costs a round trip)."""
    batches = _device_batches(experts, batch_bytes)
    rows = np.concatenate([pairs for batch in batches for pairs, _ in batch])
    x = torch.from_numpy(pair_x[rows]).to(experts[0][1].where_on_device())
    outputs, at = [], 0
    for batch in batches:
        counts = [len(pairs) for pairs, _ in batch]
        xs = x[at:at + sum(counts)]
        if len(batch) == 1:
            outputs.append(batch[0][1].compute_on_device(xs))
        else:
            meta = batch[0][1].resident.entry.tensors
            outputs.append(swiglu_batch_on_device(xs, counts, meta, [e.device_arrays() for _, e in batch]))
        at += sum(counts)
    y[rows] = torch.cat(outputs).cpu().numpy()


def _device_batches(experts: list[tuple[np.ndarray, QuantizedExpert]], batch_bytes: int) -> list[list]:
    """The experts in batches dequantized together: SwiGLU experts of one batch_key, as many as fit
    in batch_bytes of float32 weights (so that large experts still go one at a time and a batch stays
    a small share of a small device's memory); any other expert alone."""
    groups: dict[tuple | None, list] = {}
    for pair in experts:
        expert = pair[1]
        key = batch_key(expert.resident.entry.tensors) if expert.activation is None and batch_bytes else None
        groups.setdefault(key, []).append(pair)
    batches = []
    for key, members in groups.items():
        size = 1 if key is None else max(1, batch_bytes // float_bytes(members[0][1].resident.entry.tensors))
        batches += [members[at:at + size] for at in range(0, len(members), size)]
    return batches


def _path_widths(bits: np.ndarray, batches: ExpertBatches) -> set[tuple[int, int]]:
    """The (width, token count) pairs the active experts' paths are chosen by (ExpertBatches.path_groups),
    each once; bits [A]: the experts' widths."""
    if batches.parts is None:
        return set(zip(bits.tolist(), np.diff(batches.starts).tolist()))
    experts, counts = batches.path_counts()
    return set(zip(bits[experts].tolist(), counts.tolist()))


def _weighted_sum(x: torch.Tensor, batches: ExpertBatches, y: np.ndarray) -> torch.Tensor:
    """out [T, D]: each pair's output y [P, D] times its routing weight, added into its token's row in
    pair order (kernels.weighted_sum: the bits of a scatter-add expert after expert)."""
    out = torch.zeros_like(x)
    weighted_sum(y, batches.pair_tokens.numpy(), batches.pair_weights.numpy(), out.numpy())
    return out


def _weakly_chosen(batches: ExpertBatches, below: float) -> set[int]:
    """The experts every one of whose tokens chose them with a weight below `below`, never as that
    token's strongest choice (so a token always keeps its first expert as it is)."""
    if not below or not batches.experts:
        return set()
    tokens = torch.cat(batches.tokens)
    strongest = torch.zeros(int(tokens.max()) + 1).scatter_reduce_(0, tokens, torch.cat(batches.weights), "amax",
                                                                  include_self=False)
    return {e for e, t, w in batches if bool((w < below).all()) and bool((w < strongest[t]).all())}
