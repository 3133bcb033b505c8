"""Dense weight matrices quantized at load (--dense-bits): packed INT8 or INT4 codes per output
channel, multiplied by the experts' kernels.

A decode token reads every dense matrix once. On an AVX2 CPU without native bfloat16 they are
float32 (edgemoe/precision.py), and on the Mixtral-shaped 3B model that is 468 MB a token against
356 MB of INT4 experts; INT8 codes read a quarter of it. Quantized: the attention projections (and
their MLA latents), dense-MLP layers, shared experts and the LM head. Not quantized: the embedding
(a row gather, not a multiply; as loaded), the routers (expert choice is sensitive and their
matrices are small: float32 copies), norms and biases (as loaded).

A QuantizedLinear multiplies a few tokens on the integer kernel (int8 activations, edgemoe.kernels
.qmatmul_int), more by dequantizing once and one float32 GEMM: per token the kernel redoes its dot
products, so a GEMM wins from some token count on, KERNEL_MAX_TOKENS per width (measured with
tools/bench_dense_dtype.py on 1024 x 1024: docs/benchmarks.md).

Shapes: T tokens, R rows (outputs), C columns (inputs).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from edgemoe import kernels
from edgemoe.quant import QuantizedTensor, quantize

DENSE_BITS = (8, 4)
# Per output channel at 8 bits; groups of 128 inputs at 4 bits, where one scale per row of 1024 or
# more loses too much (the eval figures in docs/benchmarks.md).
GROUP_SIZE = {8: None, 4: 128}
QUANTIZED_ROLES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "mlp.gate", "mlp.up", "mlp.down",
                   "shared.gate", "shared.up", "shared.down", "cross.q", "cross.k", "cross.v", "cross.o")
KERNEL_MAX_TOKENS = {8: 16, 4: 16}   # tools/bench_dense_dtype.py: both kernels beat the GEMM up to 16 tokens
# A matrix is quantized this many bytes of its float32 rows at a time (rows are quantized on their own,
# so the codes are the same): the quantizer's float32 temporaries, several times the block, stay small
# beside the weights. Quantized whole, they raised bench-qwen3moe's load peak by about 330 MiB; 16 MiB
# blocks still 80 MiB more than 4 MiB ones (tools/bench_run_memory.py, docs/scheduling.md).
QUANTIZE_BLOCK_BYTES = 4 << 20


class QuantizedLinear:
    """A weight [R, C] as packed codes; called on x [T, C] it returns float32 [T, R] (edgemoe.layers.linear).
    gemm_dtype: the GEMM's type for long steps, the dtype of the matrix it replaces where that is
    bfloat16 (loaded so because the CPU multiplies it natively: 2.2x float32's speed on a 512-token
    step here, docs/benchmarks.md), else float32."""

    def __init__(self, qt: QuantizedTensor, gemm_dtype: torch.dtype = torch.float32):
        self.qt = qt
        self.gemm_dtype = gemm_dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.qt.shape

    @property
    def nbytes(self) -> int:
        return self.qt.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.shape[0] <= KERNEL_MAX_TOKENS[self.qt.bits]:
            return torch.from_numpy(kernels.qmatmul_int(x.contiguous().numpy(), self.qt))
        return F.linear(x.to(self.gemm_dtype), kernels.dequantize(self.qt, self.gemm_dtype)).float()


def quantize_matrix(weight: torch.Tensor | QuantizedLinear, bits: int,
                    dtype: torch.dtype | None = None) -> QuantizedLinear:
    """weight's QuantizedLinear; one already quantized (a store's load quantizes as it reads) as it is.
    dtype: the type the matrix would be kept in (None: weight's own), which sets the copy's GEMM type;
    rows are converted to it a block at a time (quantize_rows)."""
    if isinstance(weight, QuantizedLinear):
        return weight
    return quantize_rows(lambda start, stop: weight[start:stop], tuple(weight.shape), bits, dtype or weight.dtype)


def quantize_rows(read: Callable[[int, int], torch.Tensor], shape: tuple[int, int], bits: int,
                  dtype: torch.dtype) -> QuantizedLinear:
    """The QuantizedLinear of an [R, C] matrix given by its rows: read(start, stop) returns rows
    start..stop-1 (from a tensor, or straight from a file), converted here to `dtype`, the type the
    matrix would be kept in (it sets the GEMM type). QUANTIZE_BLOCK_BYTES of float32 rows at a time,
    written into the codes' arrays, so that neither a float copy of the matrix nor a second copy of
    its codes is ever held (the same codes as quantizing it whole: rows are quantized on their own)."""
    rows, _ = shape
    step = max(1, QUANTIZE_BLOCK_BYTES // (4 * shape[1]))
    arrays = None
    for start in range(0, rows, step):
        block = quantize(read(start, min(start + step, rows)).to(dtype), bits, GROUP_SIZE[bits])
        if arrays is None:
            arrays = {name: np.empty((rows, *getattr(block, name).shape[1:]), getattr(block, name).dtype)
                      for name in ("packed", "scale", "zero")}
        for name, array in arrays.items():
            array[start:start + block.shape[0]] = getattr(block, name)
    qt = QuantizedTensor(bits, GROUP_SIZE[bits], shape, arrays["packed"], arrays["scale"], arrays["zero"])
    return QuantizedLinear(qt, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


def quantized_at_load(name: str) -> bool:
    """Whether quantize_dense replaces this dense tensor (by its canonical name) by a quantized copy:
    the LM head and each layer's QUANTIZED_ROLES."""
    parts = name.split(".", 2)
    return name == "lm_head" or (len(parts) == 3 and parts[0] == "layers" and parts[2] in QUANTIZED_ROLES)


def quantize_layer(weights: dict, bits: int) -> dict:
    """One decoder layer's weights (canonical names) with its QUANTIZED_ROLES quantized and its router
    in float32 (as exact as loaded, multiplied without rounding the input to bfloat16). The q, k and
    v projections of grouped-query attention become one matrix "qkv" (their rows stacked): one kernel
    call a step instead of three, the same bits (rows are quantized and multiplied independently)."""
    out = {name: quantize_matrix(w, bits) if name in QUANTIZED_ROLES else w for name, w in weights.items()}
    if "router" in out:   # small, and torch's bfloat16 product of one row takes 4x float32's (docs/benchmarks.md)
        out["router"] = out["router"].float()
    if all(role in out for role in ("q", "k", "v")):
        parts = [out.pop(role) for role in ("q", "k", "v")]
        out["qkv"] = QuantizedLinear(_stacked([p.qt for p in parts]), parts[0].gemm_dtype)
    return out


def _stacked(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Matrices of one width, group size and column count as one, rows in order."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    return QuantizedTensor(first.bits, first.group_size, (rows, first.shape[1]),
                           *(np.concatenate([getattr(p, name) for p in parts]) for name in ("packed", "scale", "zero")))


def dense_bits_for(choice: int | str | None, manifest, spec) -> int | None:
    """The width of the dense matrices for a load: 8, 4 or None (as loaded). manifest: the store's
    (edgemoe.store.Manifest), None for a checkpoint directory. choice "auto" (the commands' default):
    - as loaded for a checkpoint directory (the model as published);
    - 4 (groups of 128) for a store whose experts are all at 4 bits or fewer and were not chosen by a
      quality budget: its user asked for a 4-bit model, as a Q4_0 file quantizes its attention at 4
      bits too (+0.17% perplexity on the bundled model, and a token reads half of INT8's dense
      bytes: docs/benchmarks.md);
    - 8 for any other store: wider experts, or widths a quality budget chose (that search measures
      the experts' loss, so the dense matrices stay near exact: +0.011% perplexity at INT8)."""
    if choice != "auto":
        return None if choice in (None, "none") else int(choice)
    if manifest is None:
        return None
    narrow = max(e.bits for e in manifest.experts.values()) <= 4
    return 4 if narrow and "budget" not in manifest.data else 8
