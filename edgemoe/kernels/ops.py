"""The kernels' Python entry points: argument checks, zero-padding of activations, output buffers.

Shapes: T tokens, R rows, C columns, NG groups, G padded group size, Cp = NG * G, D hidden,
I expert hidden. Activations are numpy float32 [T, C], C-contiguous; outputs are new arrays.

Float path: qmatmul, swiglu_expert (edgemoe/kernels/cpu.py). Integer path: qmatmul_int, swiglu_expert_int
(edgemoe/kernels/cpu_int.py), on one of int_paths(): "avx512vnni" where numba compiles for a CPU with AVX-512
VNNI, "avx2" for an AVX2 CPU, "portable" everywhere. A call's path is its `path` argument, else $EDGEMOE_INT_PATH, else the fastest available.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from edgemoe.quant import QuantizedTensor

from . import cpu, cpu_int
from ._jit import target_has
from .views import address

INT_PATHS = {"avx512vnni": cpu_int.VNNI, "avx2": cpu_int.AVX2, "portable": cpu_int.PORTABLE}  # fastest first
# LLVM features each path needs (VNNI's: AVX-512 BW too, for the masked load of a row's last bytes)
PATH_FEATURES = {"avx512vnni": ("avx512vnni", "avx512bw", "avx2"), "avx2": ("avx2",), "portable": ()}
INT_PATH_ENV = "EDGEMOE_INT_PATH"
MAX_INT_SUM = 2**31 - 1  # integer sums are int32 in the AVX2 lanes


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


def _check_expert(gate, up, down) -> tuple[int, int]:
    """(I, D) of a SwiGLU expert: gate, up [I, D] with the same bits and group_size, down [D, I]."""
    for name, qt in (("gate", gate), ("up", up), ("down", down)):
        _check_qt(name, qt)
    inner, dim = gate.shape
    if up.shape != (inner, dim) or down.shape != (dim, inner):
        raise ValueError(f"gate {gate.shape}, up {up.shape}, down {down.shape}: expected [I, D], [I, D], [D, I]")
    if (up.bits, up.group_size) != (gate.bits, gate.group_size):
        raise ValueError(f"up: bits={up.bits}, group_size={up.group_size} must match gate's "
                         f"({gate.bits}, {gate.group_size})")
    return inner, dim


def swiglu_expert(x: np.ndarray, gate: QuantizedTensor, up: QuantizedTensor,
                  down: QuantizedTensor) -> np.ndarray:
    """down(silu(gate x) * (up x)) in one parallel kernel: x float32 [T, D] -> float32 [T, D].

    gate, up: [I, D] with the same bits and group_size (decoded side by side); down: [D, I], any.
    """
    inner, dim = _check_expert(gate, up, down)
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


def kernels_compiled() -> bool:
    """Whether numba's cache holds code compiled for this CPU for the integer kernels every store run
    calls: where it does not, the run compiles them, which a process keeps about 250 MiB for
    (edgemoe.store.memory.KERNEL_COMPILE_GROWTH). A cache numba cannot read counts as not compiled.
    Reads numba's cache index through its dispatcher's private `_cache` (numba 0.59-0.68)."""
    try:
        from numba.core.registry import cpu_target
        machine = cpu_target.target_context.codegen().magic_tuple()
        return all(any(key[1] == machine for key in kernel._cache._cache_file._load_index())
                   for kernel in (cpu_int.qmatmul_int_kernel, cpu_int.swiglu_experts_int_kernel))
    except Exception:   # a numba whose cache internals differ: assume the compile, the safe side
        return False


def int_paths() -> tuple[str, ...]:
    """The integer paths numba can run on this CPU, fastest first."""
    return tuple(p for p in INT_PATHS if all(target_has(f) for f in PATH_FEATURES[p]))


def default_int_path() -> str:
    """$EDGEMOE_INT_PATH if set, else the fastest of int_paths()."""
    return os.environ.get(INT_PATH_ENV) or int_paths()[0]


def _int_path(path: str | None) -> int:
    return _int_path_code(path, os.environ.get(INT_PATH_ENV))


@functools.lru_cache(maxsize=None)   # asked on every kernel call: a decode token makes hundreds
def _int_path_code(path: str | None, environment: str | None) -> int:
    name = path if path is not None else environment or int_paths()[0]
    if name not in int_paths():
        source = f"${INT_PATH_ENV}" if path is None else "path"
        raise ValueError(f"{source}={name!r}: this CPU runs the integer paths {int_paths()}")
    return INT_PATHS[name]


def _check_int_sums(name: str, qt: QuantizedTensor) -> QuantizedTensor:
    """A group's integer sum, at most qmax * 127 * G in magnitude, must fit int32."""
    if ((1 << qt.bits) - 1) * 127 * qt.group > MAX_INT_SUM:
        raise ValueError(f"{name}: groups of {qt.group} columns at {qt.bits} bits overflow the integer "
                         f"path's int32 sums; quantize with a smaller group_size or use the float path")
    return qt


def quantize_activations(x: np.ndarray, qt: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [T, C] -> xq int8 [T, Cp] (zero-padded), xs float32 [T, NG], qs int64 [T, NG], on qt's groups."""
    ntok = x.shape[0]
    xq = np.zeros((ntok, qt.ngroups * qt.group), np.int8)
    xs = np.empty((ntok, qt.ngroups), np.float32)
    qs = np.empty((ntok, qt.ngroups), np.int64)
    cpu_int.quantize_activations_kernel(x, qt.group, xq, xs, qs)
    return xq, xs, qs


def qmatmul_int(x: np.ndarray, qt: QuantizedTensor, path: str | None = None) -> np.ndarray:
    """y = x @ W^T on the integer path (x quantized to int8 per token and group): float32 [T, C] -> [T, R]."""
    code = _int_path(path)
    _check_int_sums("qt", _check_qt("qt", qt))
    x = _check_x("x", x, qt.shape[1])
    out = np.empty((x.shape[0], qt.shape[0]), np.float32)
    cpu_int.qmatmul_int_kernel(code, qt.bits, qt.group, qt.packed.reshape(-1), qt.scale, qt.zero, x, out,
                               cpu.row_blocks())
    return out


def swiglu_expert_int(x: np.ndarray, gate: QuantizedTensor, up: QuantizedTensor,
                      down: QuantizedTensor, path: str | None = None) -> np.ndarray:
    """swiglu_expert on the integer path: x and the intermediate activation quantized to int8."""
    code = _int_path(path)
    inner, dim = _check_expert(gate, up, down)
    for name, qt in (("gate", gate), ("down", down)):  # up has gate's bits and groups
        _check_int_sums(name, qt)
    xq, xs, qs = quantize_activations(_check_x("x", x, dim), gate)
    ntok = x.shape[0]
    hg, hu, h = (np.empty((ntok, inner), np.float32) for _ in range(3))
    hq = np.zeros((ntok, down.ngroups * down.group), np.int8)
    hs = np.empty((ntok, down.ngroups), np.float32)
    hqs = np.empty((ntok, down.ngroups), np.int64)
    out = np.empty((ntok, dim), np.float32)
    cpu_int.swiglu_int_kernel(code, gate.bits, gate.group, gate.packed.reshape(-1), gate.scale, gate.zero,
                              up.packed.reshape(-1), up.scale, up.zero, xq.reshape(-1), xs, qs,
                              down.bits, down.group, down.packed.reshape(-1), down.scale, down.zero,
                              hg, hu, h, hq, hs, hqs, out, cpu.row_blocks())
    return out


def expert_layout(gate: QuantizedTensor | None, up: QuantizedTensor, down: QuantizedTensor) -> np.ndarray:
    """An expert's row of swiglu_experts_int's layout table (int64 [LAYOUT_COLUMNS]): its arrays'
    addresses, widths and groups, checked once here; SwiGLU, or with gate None an ungated relu expert
    (kind KIND_RELU, no gate addresses, up's width and groups where gate's go). The row is valid while
    the tensors live."""
    first = up if gate is None else gate   # the matrix the token is quantized for
    inner, dim = _check_expert(first, up, down)
    for name, qt in (("up", up), ("down", down)):
        _check_int_sums(name, qt)
    row = np.zeros(cpu_int.LAYOUT_COLUMNS, np.int64)    # no biases
    if gate is not None:
        row[:3] = [address(a) for a in (gate.packed, gate.scale, gate.zero)]
    row[3:9] = [address(a) for qt in (up, down) for a in (qt.packed, qt.scale, qt.zero)]
    row[9:cpu_int.KIND] = (first.bits, first.group, first.ngroups, down.bits, down.group, down.ngroups, inner, dim)
    row[cpu_int.KIND] = cpu_int.KIND_RELU if gate is None else cpu_int.KIND_SWIGLU
    return row


def gpt_oss_arrays(gate_bias: torch.Tensor, up_bias: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                   limit: float) -> tuple[np.ndarray, ...]:
    """GPT-OSS's expert arguments (edgemoe/kernels/activations.py's gpt_oss_expert) as the float32
    contiguous arrays a layout row points to: gate bias [I], up bias [I], down bias [D], (alpha, limit)."""
    arrays = [np.ascontiguousarray(t.detach().float().numpy()) for t in (gate_bias, up_bias, down_bias)]
    return (*arrays, np.array([alpha, limit], np.float32))


def gpt_oss_layout(row: np.ndarray, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
    """A copy of an expert's layout row (expert_layout) computing GPT-OSS's clamped SwiGLU with biases,
    arrays from gpt_oss_arrays; valid while they live."""
    inner, dim = int(row[cpu_int.INNER]), int(row[cpu_int.HIDDEN])
    gate_bias, up_bias, down_bias, params = arrays
    for name, a, n in (("gate bias", gate_bias, inner), ("up bias", up_bias, inner), ("down bias", down_bias, dim),
                       ("(alpha, limit)", params, 2)):
        if a.dtype != np.float32 or a.shape != (n,) or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected float32 [{n}] contiguous, got {a.dtype}{list(a.shape)}")
    out = row.copy()
    out[cpu_int.KIND] = cpu_int.KIND_GPT_OSS
    out[cpu_int.GATE_BIAS:cpu_int.PARAMS + 1] = [address(a) for a in arrays]
    return out


def swiglu_experts_int(x: np.ndarray, layouts: np.ndarray, starts: np.ndarray,
                       path: str | None = None) -> np.ndarray:
    """Several experts of one layer in one kernel call, on the integer path: x float32 [P, D], the
    token of each (token, expert) pair, pairs grouped by expert; layouts int64 [A, LAYOUT_COLUMNS]
    (expert_layout, or gpt_oss_layout for a GPT-OSS expert; one row per expert, all of one shape);
    starts int64 [A + 1], expert a's pairs being starts[a] <= p < starts[a + 1]. Returns float32
    [P, D], each pair's row bit-identical to swiglu_expert_int of its expert on its token (SwiGLU), or
    to the expert alone in this call (GPT-OSS). The caller keeps the experts' arrays alive."""
    code = _int_path(path)
    problem = cpu_int.layout_problem(layouts, starts, x.shape[0])
    if problem == 1:
        shapes = layouts[:, cpu_int.INNER:]
        raise ValueError(f"layouts: experts of one call must share their shape, got (I, D) {np.unique(shapes, axis=0).tolist()}")
    if problem == 2:
        raise ValueError(f"starts: expected {len(layouts) + 1} ascending offsets from 0 to {x.shape[0]}, got {starts.tolist()}")
    y = np.empty(x.shape, np.float32)
    if len(layouts):
        _check_x("x", x, int(layouts[0, cpu_int.HIDDEN]))
        cpu_int.swiglu_experts_int_kernel(code, layouts, starts, x, int(layouts[0, cpu_int.INNER]), y, cpu.row_blocks())
    return y


def weighted_sum(y: np.ndarray, tokens: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """out[tokens[p]] += y[p] * weights[p] for every pair p, in order (float32 y [P, D], out [T, D],
    int64 tokens [P], float32 weights [P]): the sum a scatter-add of each expert's weighted
    outputs, expert after expert, makes, product and addition rounded alike."""
    if not (y.dtype == out.dtype == weights.dtype == np.float32 and y.shape[1:] == out.shape[1:]
            and len(tokens) == len(weights) == len(y)):
        raise ValueError(f"y {y.dtype}{y.shape}, tokens {tokens.shape}, weights {weights.dtype}{weights.shape}, "
                         f"out {out.dtype}{out.shape}: expected float32 [P, D], [P], [P] and [T, D]")
    cpu_int.weighted_sum_kernel(y, tokens, weights, out)
