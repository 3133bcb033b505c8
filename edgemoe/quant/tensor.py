"""Per output channel asymmetric linear quantization at 2, 4 and 8 bits, and the QuantizedTensor.

Shapes: R rows (output channels), C columns (input dim), NG groups per row, G padded group size,
Cp = NG * G padded columns, B = G * bits / 8 bytes per group.

A weight w[r, c] in group g = c // G is stored as an unsigned code q and read back as
(q - zero[r, g]) * scale[r, g]. Groups split a row along C; group_size=None means one group per row.
When G does not divide C the row is padded at its end (the padding repeats the row's last value,
so it never widens a group's range); kernels multiply the padding by zero activations.

scale and zero are float32 [R, NG]. Not float16: zero is in code units (HQQ's convention) and
reaches -min / scale, which float16 cannot hold for rows far from 0 relative to their range, and
a constant row needs scale = 1, zero = -value to come back exactly. The cost is 8 bytes per group:
negligible per row (0.016 bits per weight at C = 4096), 0.5 bits per weight at G = 128.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .formats import QuantError, get_format

METHODS = ("rtn", "hqq")

# hqq's fast proximal solver (early stopping), with its published defaults; it refines the zero
# point, the scale stays min-max. Always CPU float32: hqq's own defaults assume CUDA and fp16.
HQQ_PARAMS = {"lp_norm": 0.7, "beta": 1e1, "kappa": 1.01, "iters": 20, "tol": 0.0,
              "early_stop": True, "scale_gridsearch": False}

ARRAY_DTYPES = {"packed": np.uint8, "scale": np.float32, "zero": np.float32}


def group_layout(bits: int, group_size: int | None, cols: int) -> tuple[int, int]:
    """(G, NG): padded group size and groups per row for a row of `cols` columns."""
    fmt = get_format(bits)
    if group_size is None:
        return fmt.padded_group(cols), 1
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size <= 0:
        raise QuantError(f"group_size={group_size!r}: expected None or a positive int")
    if group_size % fmt.per_byte:
        raise QuantError(f"group_size={group_size}: must be a multiple of {fmt.per_byte} "
                         f"at {bits} bits ({fmt.per_byte} codes per byte)")
    return int(group_size), -(-cols // group_size)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A [R, C] weight as packed codes plus float32 scale and zero per (row, group).

    The arrays are read-only views (never written, so they may come from a read-only mmap).
    """

    bits: int
    group_size: int | None
    shape: tuple[int, int]
    packed: np.ndarray  # uint8 [R, NG * B]
    scale: np.ndarray  # float32 [R, NG]
    zero: np.ndarray  # float32 [R, NG]

    def __post_init__(self):
        rows, cols = self.shape
        group, ng = group_layout(self.bits, self.group_size, cols)
        want = {"packed": (rows, ng * group * self.bits // 8), "scale": (rows, ng), "zero": (rows, ng)}
        for name, shape in want.items():
            object.__setattr__(self, name, _readonly_view(name, getattr(self, name), shape))
        object.__setattr__(self, "_group", group)   # read on every kernel call: computed once

    @property
    def group(self) -> int:
        """G, the padded group size (whole padded row when group_size is None)."""
        return self._group

    @property
    def ngroups(self) -> int:
        return self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat named arrays (views): what a store writes as raw bytes, and from_arrays reads."""
        return {"packed": self.packed.reshape(-1), "scale": self.scale.reshape(-1),
                "zero": self.zero.reshape(-1)}

    @classmethod
    def from_arrays(cls, bits: int, group_size: int | None, shape, arrays: dict[str, np.ndarray]):
        """Rebuild from arrays() output or from views of a buffer, without copying."""
        missing = set(ARRAY_DTYPES) - set(arrays)
        if missing:
            raise QuantError(f"arrays: missing {sorted(missing)} (have {sorted(arrays)})")
        rows, cols = _check_shape(shape)
        return cls(get_format(bits).bits, group_size, (rows, cols),
                   arrays["packed"], arrays["scale"], arrays["zero"])

    @classmethod
    def checked_views(cls, bits: int, group_size: int | None, shape: tuple[int, int], group: int,
                      packed: np.ndarray, scale: np.ndarray, zero: np.ndarray):
        """A QuantizedTensor over read-only views of the shapes from_arrays checked before for this
        layout (edgemoe.store.format.ExpertEntry.views): not checked again, for a store's every read."""
        qt = object.__new__(cls)
        for name, value in (("bits", bits), ("group_size", group_size), ("shape", shape), ("packed", packed),
                            ("scale", scale), ("zero", zero), ("_group", group)):
            object.__setattr__(qt, name, value)
        return qt


def _check_shape(shape) -> tuple[int, int]:
    if len(shape) != 2 or any(not isinstance(n, numbers.Integral) or n <= 0 for n in shape):
        raise QuantError(f"shape={tuple(shape)!r}: expected (rows, cols), both positive ints")
    return int(shape[0]), int(shape[1])


def _readonly_view(name: str, a: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """a as a read-only C-contiguous view of `shape`; an error instead of any copy."""
    if not isinstance(a, np.ndarray) or a.dtype != ARRAY_DTYPES[name]:
        got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        raise QuantError(f"{name}: expected a numpy {np.dtype(ARRAY_DTYPES[name])} array, got {got}")
    if a.size != shape[0] * shape[1] or not a.flags.c_contiguous:
        raise QuantError(f"{name}: expected {shape[0] * shape[1]} C-contiguous elements {shape}, "
                         f"got shape {a.shape} (c_contiguous={a.flags.c_contiguous})")
    view = a.reshape(shape).view()
    view.flags.writeable = False
    return view


def quantize(w: torch.Tensor, bits: int, group_size: int | None = None, method: str = "rtn"):
    """w float [R, C] -> QuantizedTensor. method "rtn" (round to nearest) or "hqq" (refined zero)."""
    fmt = get_format(bits)
    if method not in METHODS:
        raise QuantError(f"method={method!r}: expected one of {METHODS}")
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or not w.is_floating_point() or w.numel() == 0:
        desc = f"{tuple(w.shape)} {w.dtype}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise QuantError(f"w: expected a non-empty 2-D float torch tensor [rows, cols], got {desc}")
    rows, cols = w.shape
    group, ng = group_layout(fmt.bits, group_size, cols)
    wf = w.detach().to(device="cpu", dtype=torch.float32)
    bad = int((~torch.isfinite(wf)).sum())
    if bad:
        raise QuantError(f"w: {bad} non-finite values (nan/inf) in a {rows}x{cols} weight")
    pad = ng * group - cols
    wg = torch.cat([wf, wf[:, -1:].expand(rows, pad)], dim=1).reshape(rows, ng, group)  # [R, NG, G]
    codes, scale, zero = _rtn(wg, fmt.qmax)
    if method == "hqq":
        codes, scale, zero = _hqq(wg, scale, zero, fmt.qmax)
    return QuantizedTensor(fmt.bits, group_size, (rows, cols), fmt.pack(codes).numpy(),
                           scale.squeeze(-1).numpy(), zero.squeeze(-1).numpy())


def _rtn(wg: torch.Tensor, qmax: int):
    """Min-max scale and zero per group, codes rounded to nearest: codes [R, NG, G], scale/zero [R, NG, 1]."""
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = (hi - lo) / qmax
    # A constant group (or one whose range underflows) gets scale 1, zero -lo: codes 0, exact.
    scale = torch.where(scale >= torch.finfo(torch.float32).tiny, scale, torch.ones_like(scale))
    codes = torch.round((wg - lo) / scale).clamp_(0, qmax).to(torch.uint8)
    return codes, scale, -lo / scale


def _hqq(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int):
    """hqq's proximal solver on each group, started from RTN; same returns as _rtn."""
    from hqq.core.optimize import optimize_weights_proximal_v2  # heavy import, only when asked

    rows, ng, group = wg.shape
    codes, inv_scale, zero = optimize_weights_proximal_v2(
        wg.reshape(-1, group), (1 / scale).reshape(-1, 1), zero.reshape(-1, 1), min_max=[0, qmax],
        axis=1, device="cpu", dtype=torch.float32, opt_params=HQQ_PARAMS)
    scale = (1 / inv_scale).reshape(rows, ng, 1)
    return codes.to(torch.uint8).reshape(rows, ng, group), scale, zero.reshape(rows, ng, 1)


def narrow(qt: QuantizedTensor, bits: int) -> QuantizedTensor:
    """The high `bits` bit planes of qt's codes, as a QuantizedTensor of that width: a cheap copy of
    the same weight (the store's fallback copies). A code q becomes q >> s (s = qt.bits - bits) and
    reads back as the middle of its bucket of 2^s codes: scale' = scale * 2^s, zero' = (zero -
    (2^s - 1) / 2) / 2^s. The buckets span the group's central range, not its extremes as a min-max
    grid of 2^bits levels does, and measure closer to the weights (docs/quantization.md). A group
    whose codes are all equal keeps its exact value (code 0, zero' = zero - its code)."""
    fmt = get_format(bits)
    if bits >= qt.bits:
        raise QuantError(f"bits={bits}: a narrowed copy must be narrower than the tensor's {qt.bits} bits")
    rows, cols = qt.shape
    group, ng = group_layout(fmt.bits, qt.group_size, cols)
    codes = get_format(qt.bits).unpack(torch.from_numpy(qt.packed.copy()), qt.group)
    codes = codes.reshape(rows, -1)[:, :cols]
    codes = torch.cat([codes, codes[:, -1:].expand(rows, ng * group - cols)], dim=1).reshape(rows, ng, group)
    shift = qt.bits - bits
    scale, zero = torch.from_numpy(qt.scale.copy()), torch.from_numpy(qt.zero.copy())
    high = codes >> shift
    constant = codes.amin(-1) == codes.amax(-1)                            # [R, NG]
    new_scale = torch.where(constant, scale, scale * (1 << shift))
    new_zero = torch.where(constant, zero - codes[..., 0].float(), (zero - ((1 << shift) - 1) / 2) / (1 << shift))
    high[constant] = 0
    return QuantizedTensor(fmt.bits, qt.group_size, qt.shape, fmt.pack(high).numpy(),
                           new_scale.numpy(), new_zero.numpy())


def dequantize_reference(qt: QuantizedTensor) -> torch.Tensor:
    """The reference dequantization in plain torch: float32 [R, C]."""
    arrays = {name: torch.tensor(getattr(qt, name)) for name in ARRAY_DTYPES}   # torch.tensor copies
    return dequantize_arrays(arrays, qt.bits, qt.group, qt.shape)


def dequantize_arrays(arrays: dict[str, torch.Tensor], bits: int, group: int, shape) -> torch.Tensor:
    """Dequantize packed/scale/zero held as torch tensors, on whatever device they are: float32
    [R, C] there. The one torch dequantization: the reference, the kernels' torch twins and the
    device path all use it. group: the padded group size (group_layout)."""
    codes = get_format(bits).unpack(arrays["packed"], group)   # [R, NG, G]
    w = (codes.to(torch.float32) - arrays["zero"][..., None]) * arrays["scale"][..., None]
    return w.reshape(shape[0], -1)[:, : shape[1]]
