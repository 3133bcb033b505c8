"""numba CPU kernels on int8 activations x packed INT2/4/8 codes, with exact integer dot products.

Shapes: T tokens, R rows (output channels), C columns, NG groups per row, G padded group size,
Cp = NG * G padded columns, P = G * bits / 8 codes per plane (= bytes per group), D hidden,
I expert hidden.

Activations are quantized per token and per group of the weight (the whole row when ungrouped):
symmetric int8, xs[t, g] = max|x[t, group g]| / 127, xq = rint(x / xs) (round half to even; an
all-zero group gets xs = 0 and xq = 0), qs[t, g] = sum of xq over the group. A weight is
(code - zero) * scale, so

    y[t, r] = sum over g, in order, of (scale[r, g] * xs[t, g]) * (float32(isum) - zero[r, g] * float32(qs[t, g]))
    isum    = sum over the group's columns k of code[r, k] * xq[t, k]     (exact integer)

The float epilogue is compiled without fastmath (no reassociation, no FMA contraction), so
edgemoe/kernels/reference.py repeats it operation for operation and the results are bit-identical.

Paths (chosen per call by edgemoe/kernels/ops.py): PORTABLE, plain numba integer loops that LLVM vectorizes
for whatever CPU it compiles for; AVX2, edgemoe/kernels/simd.py's intrinsics over whole 32-byte blocks, the
portable loop for the bytes past the last block. Integer sums are exact, so both give the same bits.

Reproducibility: parallel over blocks of output rows, each output computed by one thread in a fixed
order: results do not depend on the thread count, nor on the batch a token comes in (a token loop).
"""

from __future__ import annotations

import numba
import numpy as np

from ._jit import njit_exact, njit_exact_parallel
from .cpu import _block_size
from .simd import BLOCK, avx2_dot2, avx2_dot4, avx2_dot8

PORTABLE, AVX2 = 0, 1
U0, UB = np.uint64(0), np.uint64(BLOCK)


@njit_exact
def _portable_dot(bits, packed, b0, plane, nb, xq, x0):
    """Sum of code * xq over bytes packed[b0 : b0 + nb]: plane j of byte b0 + k meets xq[x0 + j * plane + k].

    int16 operands and an int32 accumulator (the np.int32 casts): LLVM then vectorizes with 16-bit
    multiplies and 32-bit lanes (an isolated INT4 loop over 128k codes, 1 thread, contended: 10 us
    against 127 us with an int64 accumulator). Exact: no partial sum exceeds qmax * 127 * G, which
    edgemoe/kernels/ops.py keeps below 2^31.
    """
    acc = np.int32(0)
    if bits == 8:
        for k in range(nb):
            acc = np.int32(acc + np.int16(packed[b0 + k]) * np.int16(xq[x0 + k]))
    elif bits == 4:
        for k in range(nb):
            acc = np.int32(acc + np.int16(packed[b0 + k] & np.uint8(15)) * np.int16(xq[x0 + k]))
        x1 = x0 + plane
        for k in range(nb):
            acc = np.int32(acc + np.int16(packed[b0 + k] >> np.uint8(4)) * np.int16(xq[x1 + k]))
    else:
        x1 = x0 + plane
        x2 = x1 + plane
        x3 = x2 + plane
        for k in range(nb):
            acc = np.int32(acc + np.int16(packed[b0 + k] & np.uint8(3)) * np.int16(xq[x0 + k]))
        for k in range(nb):
            acc = np.int32(acc + np.int16((packed[b0 + k] >> np.uint8(2)) & np.uint8(3)) * np.int16(xq[x1 + k]))
        for k in range(nb):
            acc = np.int32(acc + np.int16((packed[b0 + k] >> np.uint8(4)) & np.uint8(3)) * np.int16(xq[x2 + k]))
        for k in range(nb):
            acc = np.int32(acc + np.int16(packed[b0 + k] >> np.uint8(6)) * np.int16(xq[x3 + k]))
    return acc


@njit_exact
def _group_dot(path, bits, packed, b0, plane, xq, x0):
    """isum of one group: its plane bytes start at packed[b0], its activations at xq[x0] (flat, uint64 offsets)."""
    acc = np.int64(0)
    done = U0
    if path == AVX2:
        blocks = plane // UB
        if bits == 2:
            acc = np.int64(avx2_dot2(packed, b0, xq, x0, plane, blocks))
        elif bits == 4:
            acc = np.int64(avx2_dot4(packed, b0, xq, x0, plane, blocks))
        else:
            acc = np.int64(avx2_dot8(packed, b0, xq, x0, plane, blocks))
        done = blocks * UB
    return acc + _portable_dot(bits, packed, b0 + done, plane, plane - done, xq, x0 + done)


@njit_exact
def _rows(path, bits, g, packed, scale, zero, xq, xs, qs, r0, r1, out):
    """out[t, r] for rows r0 <= r < r1 and every token. packed uint8 [R * NG * P] and xq int8 [T * Cp]
    are flat; xs float32 [T, NG], qs int64 [T, NG]."""
    ntok = np.uint64(out.shape[0])
    ngroups = np.uint64(scale.shape[1])
    group = np.uint64(g)
    plane = np.uint64(g * bits // 8)
    row_bytes = ngroups * plane
    cols = ngroups * group
    for r in range(np.uint64(r0), np.uint64(r1)):
        for t in range(ntok):  # the row's bytes stay in L1 for the next token
            acc = np.float32(0)
            for gi in range(ngroups):
                isum = _group_dot(path, bits, packed, r * row_bytes + gi * plane, plane, xq, t * cols + gi * group)
                acc += (scale[r, gi] * xs[t, gi]) * (np.float32(isum) - zero[r, gi] * np.float32(qs[t, gi]))
            out[t, r] = acc


@njit_exact
def _abs_max(v):
    """max|v| of a float32 [N] array, taken on the bit patterns: with the sign bit cleared,
    non-negative floats order like their uint32 patterns (NaN above inf, so a NaN propagates), and
    an integer max reduction vectorizes where a float one without fastmath does not."""
    vbits = v.view(np.uint32)
    m = np.uint32(0)
    for c in range(vbits.shape[0]):
        m = max(m, vbits[c] & np.uint32(0x7FFFFFFF))
    return np.full(1, m, np.uint32).view(np.float32)[0]


@njit_exact
def _quantize_group(v, s, q):
    """q int8 [N] = clamp(rint(v / s), -127, 127); returns sum(q)."""
    for c in range(v.shape[0]):
        q[c] = np.int8(min(max(np.rint(v[c] / s), np.float32(-127)), np.float32(127)))
    total = 0
    for c in range(q.shape[0]):
        total += q[c]
    return total


@njit_exact
def quantize_activations_kernel(x, g, xq, xs, qs):
    """x float32 [T, C] -> xq int8 [T, Cp] (padding left as given: zeros), xs float32 [T, NG], qs int64 [T, NG]."""
    ntok, cols = x.shape
    for t in range(ntok):
        for gi in range(xs.shape[1]):
            c0, c1 = gi * g, min(cols, (gi + 1) * g)
            s = _abs_max(x[t, c0:c1]) / np.float32(127)
            xs[t, gi] = s
            qs[t, gi] = _quantize_group(x[t, c0:c1], s, xq[t, c0:c1]) if s > 0 else 0


@njit_exact_parallel
def qmatmul_int_kernel(path, bits, g, packed, scale, zero, xq, xs, qs, out, nblocks):
    """out float32 [T, R] = dequantized x @ W^T on the integer path (xq, xs, qs from quantize_activations_kernel)."""
    rows = scale.shape[0]
    size = _block_size(rows, nblocks)
    for b in numba.prange(-(-rows // size)):
        _rows(path, bits, g, packed, scale, zero, xq, xs, qs, b * size, min(rows, (b + 1) * size), out)


@njit_exact
def silu_mul(gv, uv):
    """silu(gv) * uv in float32, exp taken in float64 and rounded (edgemoe/kernels/reference.py does the same)."""
    return gv / (np.float32(1) + np.float32(np.exp(-np.float64(gv)))) * uv


@njit_exact_parallel
def swiglu_int_kernel(path, bits, g, gate_p, gate_s, gate_z, up_p, up_s, up_z, xq, xs, qs,
                      dbits, dg, down_p, down_s, down_z, hg, hu, h, hq, hs, hqs, out, nblocks):
    """out [T, D] = down(silu(gate x) * (up x)), h re-quantized to int8 per token and per group of down.
    hg, hu, h: scratch [T, I]; hq: zeros [T, Ip]; hs, hqs [T, NGd]; flat packed and xq, as _rows."""
    inner = gate_s.shape[0]
    size = _block_size(inner, nblocks)
    for b in numba.prange(-(-inner // size)):  # gate and up rows of a block together: xq stays in cache
        r0, r1 = b * size, min(inner, (b + 1) * size)
        _rows(path, bits, g, gate_p, gate_s, gate_z, xq, xs, qs, r0, r1, hg)
        _rows(path, bits, g, up_p, up_s, up_z, xq, xs, qs, r0, r1, hu)
        for t in range(h.shape[0]):
            for r in range(r0, r1):
                h[t, r] = silu_mul(hg[t, r], hu[t, r])
    quantize_activations_kernel(h, dg, hq, hs, hqs)
    hflat = hq.reshape(hq.size)
    dim = down_s.shape[0]
    size = _block_size(dim, nblocks)
    for b in numba.prange(-(-dim // size)):
        _rows(path, dbits, dg, down_p, down_s, down_z, hflat, hs, hqs, b * size, min(dim, (b + 1) * size), out)
