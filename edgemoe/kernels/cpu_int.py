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

The lane rule. A grouped matrix (NG > 1) whose planes are whole 32-byte blocks (P % 32 == 0: groups
of 128 at INT2, 64 at INT4, 32 at INT8 and their multiples) is multiplied otherwise, so that a row
pays no horizontal sum per group (dropping them halved the time of a 1024 x 1024 INT4 matrix in
groups of 128 at one token: docs/benchmarks.md). Each group's products stay in eight int32 lanes, lane l
holding the plane bytes k with (k mod 32) // 4 == l (exact integers), and with s[g] = scale[r, g] * xs[t, g]

    y[t, r] = (sum over lanes l in order of (sum over g in order of float32(lane[g, l]) * s[g]))
              - (sum over g in order of s[g] * zero[r, g] * float32(qs[t, g]))

Ungrouped rows (NG == 1) go in batches of 16 rows (VNNI, 64-byte blocks) or 8 (AVX2, 32-byte
blocks), and a prompt's tokens TOKEN_TILE at a time: each row's products stay a vector until the
batch is done and one transposed tree of shuffles and adds a token gives every row's isum
(edgemoe/kernels/simd.py's isums), a block's codes unpacked once for the tile's tokens. The bytes
past a row's last whole block (a 352-column INT4 row: 176 bytes, 48 past two 64-byte blocks) are a
masked block on VNNI, and added row by row on AVX2. A row used to pay a horizontal sum and a call
of its own, a fixed cost that fine-grained experts' short rows (3 blocks for a 384-column INT4 row)
could not hide. The isums are exact and each row's epilogue is the same, so the bits do not change.

The float epilogue is compiled without fastmath (no reassociation, no FMA contraction), so
edgemoe/kernels/reference.py repeats it operation for operation and the results are bit-identical.

Paths (chosen per call by edgemoe/kernels/ops.py): PORTABLE, plain numba integer loops that LLVM vectorizes
for whatever CPU it compiles for; AVX2, edgemoe/kernels/simd.py's intrinsics over whole 32-byte blocks, the
portable loop for the bytes past the last block; VNNI (AVX-512 VNNI), vpdpbusd over 64-byte blocks, then
AVX2 and the portable loop for what is left. Integer sums are exact, so every path gives the same bits.

Reproducibility: parallel over blocks of output rows, each output computed by one thread in a fixed
order: results do not depend on the thread count, nor on the batch a token comes in (a token loop).
"""

from __future__ import annotations

import numba
import numpy as np

from ._jit import njit_exact, njit_exact_inline, njit_exact_parallel
from .cpu import _block_size
from .simd import (AVX2_ROWS, BLOCK, LANES, TOKEN_TILE, VNNI_BLOCK, VNNI_ROWS, avx2_dot2, avx2_dot4, avx2_dot8,
                   avx2_isums2, avx2_isums4, avx2_isums8, avx2_rows2, avx2_rows4, avx2_rows8, avx2_tile_isums2,
                   avx2_tile_isums4, avx2_tile_isums8, vnni_dot2, vnni_dot4, vnni_dot8, vnni_isums4, vnni_isums8,
                   vnni_rows4, vnni_rows8, vnni_tile_isums4, vnni_tile_isums8)
from .views import float32_view, uint8_view

PORTABLE, AVX2, VNNI = 0, 1, 2
U0, UB, UV = np.uint64(0), np.uint64(BLOCK), np.uint64(VNNI_BLOCK)


@njit_exact_inline
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


@njit_exact_inline
def _avx2_blocks(bits, packed, b0, plane, xq, x0, blocks):
    if bits == 2:
        return np.int64(avx2_dot2(packed, b0, xq, x0, plane, blocks))
    if bits == 4:
        return np.int64(avx2_dot4(packed, b0, xq, x0, plane, blocks))
    return np.int64(avx2_dot8(packed, b0, xq, x0, plane, blocks))


@njit_exact_inline
def _vnni_blocks(bits, packed, b0, plane, xq, x0, blocks):
    if bits == 2:
        return np.int64(vnni_dot2(packed, b0, xq, x0, plane, blocks))
    if bits == 4:
        return np.int64(vnni_dot4(packed, b0, xq, x0, plane, blocks))
    return np.int64(vnni_dot8(packed, b0, xq, x0, plane, blocks))


@njit_exact_inline
def _group_dot(path, bits, packed, b0, plane, xq, x0):
    """isum of one group: its plane bytes start at packed[b0], its activations at xq[x0] (flat, uint64
    offsets). VNNI: 64-byte blocks, then _dot_from for the rest. INT2 stays on AVX2 blocks: its four
    planes summed in int16 before one widening beat four vpdpbusd on a Zen 4 EPYC (tools/bench_kernels.py
    --parts layer; docs/benchmarks.md)."""
    acc = np.int64(0)
    done = U0
    if path == VNNI and bits != 2:
        blocks = plane // UV
        acc = _vnni_blocks(bits, packed, b0, plane, xq, x0, blocks)
        done = blocks * UV
    return acc + _dot_from(path, bits, packed, b0, plane, done, xq, x0)


@njit_exact_inline
def _dot_from(path, bits, packed, b0, plane, done, xq, x0):
    """The isum of a group's plane bytes from `done` on (those before it summed elsewhere): 32-byte
    blocks on AVX2 (every VNNI CPU has AVX2), the bytes past the last block on the portable loop."""
    acc = np.int64(0)
    if path != PORTABLE and plane - done >= UB:
        blocks = (plane - done) // UB
        acc = _avx2_blocks(bits, packed, b0 + done, plane, xq, x0 + done, blocks)
        done += blocks * UB
    return acc + _portable_dot(bits, packed, b0 + done, plane, plane - done, xq, x0 + done)


@njit_exact_inline
def _rows_lanes(path, bits, packed, b0, plane, ngroups, group, xq, x0, scale, s0, xs, nrows, totals):
    """The lane rule's first sum (module docstring) for nrows rows and one token into totals[:nrows]:
    row i's bytes from packed[b0 + i * ngroups * plane] and scales from scale[s0 + i * ngroups] (flat),
    xq[x0:] the token's activations and xs its float32 [NG]."""
    args = (packed, b0, xq, x0, plane, ngroups, group, scale, s0, xs, nrows, totals)
    if path == VNNI and bits != 2 and plane % UV == U0:
        if bits == 8:
            vnni_rows8(*args)
        else:
            vnni_rows4(*args)
    elif path != PORTABLE:
        if bits == 2:
            avx2_rows2(*args)
        elif bits == 4:
            avx2_rows4(*args)
        else:
            avx2_rows8(*args)
    else:
        for i in range(nrows):
            totals[i] = _portable_row_lanes(bits, packed, b0 + i * ngroups * plane, plane, ngroups, group, xq, x0,
                                            scale[s0 + i * ngroups:], xs)


@njit_exact
def _portable_row_lanes(bits, packed, b0, plane, ngroups, group, xq, x0, scale, xs):
    """_rows_lanes' sum for one row on plain numba loops (scale: the row's float32 [NG] at its start).
    Each plane byte k's products go to column k mod 32 of a 32-wide int32 accumulator, a contiguous
    loop that LLVM vectorizes (a byte-by-byte scatter into the 8 lanes ran at 0.5 GB/s); lane l is then
    the sum of columns 4l..4l+3 (exact integers: the lanes' values are the same)."""
    columns = np.zeros(BLOCK, np.int32)
    acc = np.zeros(LANES, np.float32)
    mask = np.uint8((1 << bits) - 1)
    for gi in range(ngroups):
        columns[:] = 0
        pb, xb = b0 + gi * plane, x0 + gi * group
        for j in range(np.uint64(8 // bits)):
            shift = np.uint8(j * bits)
            xj = xb + j * plane
            for block in range(U0, plane, UB):
                codes = packed[pb + block:pb + block + UB]
                xblock = xq[xj + block:xj + block + UB]
                for k in range(BLOCK):
                    columns[k] += np.int32(np.int16((codes[k] >> shift) & mask) * np.int16(xblock[k]))
        s = scale[gi] * xs[gi]
        for lane in range(LANES):
            lane_sum = columns[4 * lane] + columns[4 * lane + 1] + columns[4 * lane + 2] + columns[4 * lane + 3]
            acc[lane] = acc[lane] + np.float32(lane_sum) * s
    total = acc[0]
    for lane in range(1, LANES):
        total = total + acc[lane]
    return total


@njit_exact
def _rows(path, bits, g, packed, scale, zero, xq, xstride, xs, qs, t0, t1, r0, r1, out):
    """out[t, r] for rows r0 <= r < r1 and tokens t0 <= t < t1. packed uint8 [R * NG * P] and xq
    int8 are flat, token t's activations at xq[t * xstride:]; xs float32 [T, NG], qs int64 [T, NG].
    Callers pass t0 and t1 as int64 values, never as literal constants: numba compiles a callee
    again for each literal argument (5-9 s each for this one and what it calls)."""
    ngroups = np.uint64(scale.shape[1])
    group = np.uint64(g)
    plane = np.uint64(g * bits // 8)
    row_bytes = ngroups * plane
    stride = np.uint64(xstride)
    if ngroups > 1 and plane % UB == U0:
        _lane_rows(path, bits, packed, scale, zero, xq, stride, xs, qs, t0, t1, r0, r1, out, ngroups, group, plane)
        return
    first = np.uint64(r0)
    if ngroups == 1:
        first = _batched_rows(path, bits, packed, scale, zero, xq, stride, xs, qs, t0, t1, r0, r1, out, plane)
    for r in range(first, np.uint64(r1)):
        for t in range(np.uint64(t0), np.uint64(t1)):  # the row's bytes stay in L1 for the next token
            acc = np.float32(0)
            for gi in range(ngroups):
                isum = _group_dot(path, bits, packed, r * row_bytes + gi * plane, plane, xq, t * stride + gi * group)
                acc += (scale[r, gi] * xs[t, gi]) * (np.float32(isum) - zero[r, gi] * np.float32(qs[t, gi]))
            out[t, r] = acc


@njit_exact_inline
def _row_batch(path, bits, plane):
    """Rows a batch of _batched_rows takes on this path and width, 0 where it takes none: VNNI's 16
    (INT4, INT8; a row's bytes past its whole 64-byte blocks as one masked block), AVX2's 8 where a
    row holds a whole 32-byte block."""
    if path == VNNI and bits != 2:
        return VNNI_ROWS
    if path != PORTABLE and plane >= UB:
        return AVX2_ROWS
    return 0


@njit_exact_inline
def _isums(batch, tile, bits, packed, b0, plane, xq, x0, stride, nrows, isum):
    """isum[k * batch + i] = the isum of row i < nrows <= batch of the ungrouped rows of plane bytes from
    packed[b0], for token k < tile (1 or TOKEN_TILE) of those whose activations start at xq[x0 + k *
    stride], on the intrinsics of _row_batch's choice: a VNNI batch (every byte of a row), else an
    AVX2 one (its whole 32-byte blocks). Returns the bytes of a row they cover."""
    if batch == VNNI_ROWS:
        nblocks = plane // UV
        if tile == TOKEN_TILE:
            if bits == 4:
                vnni_tile_isums4(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
            else:
                vnni_tile_isums8(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
        elif bits == 4:
            vnni_isums4(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
        else:
            vnni_isums8(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
        return plane
    nblocks = plane // UB
    if tile == TOKEN_TILE:
        if bits == 2:
            avx2_tile_isums2(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
        elif bits == 4:
            avx2_tile_isums4(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
        else:
            avx2_tile_isums8(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
    elif bits == 2:
        avx2_isums2(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
    elif bits == 4:
        avx2_isums4(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
    else:
        avx2_isums8(packed, b0, xq, x0, stride, plane, nblocks, nrows, isum)
    return nblocks * UB


@njit_exact
def _batched_rows(path, bits, packed, scale, zero, xq, stride, xs, qs, t0, t1, r0, r1, out, plane):
    """_rows for ungrouped rows (one group of `plane` bytes each) in batches of _row_batch rows, the
    last one partial, TOKEN_TILE tokens a call while that many are left; returns the first row left to
    do (r1, or r0 where no batch applies). The isums are exact integers however the bytes and tokens
    are split (the batch's whole blocks, then each row's rest), and each row's float epilogue is
    _rows' own, operation for operation: the same bits."""
    batch = np.uint64(_row_batch(path, bits, plane))
    r = np.uint64(r0)
    if batch == U0:
        return r
    tile_size = np.uint64(TOKEN_TILE)
    isum = np.empty(tile_size * batch, np.int32)
    while r < np.uint64(r1):
        nrows = min(batch, np.uint64(r1) - r)
        t = np.uint64(t0)
        while t < np.uint64(t1):   # the batch's bytes stay in L1 for the next tokens
            tile = tile_size if np.uint64(t1) - t >= tile_size else np.uint64(1)
            done = _isums(batch, tile, bits, packed, r * plane, plane, xq, t * stride, stride, nrows, isum)
            for k in range(tile):
                x0 = (t + k) * stride
                for i in range(nrows):
                    if done < plane:   # a row's bytes past its last whole block: each row's own
                        isum[k * batch + i] += np.int32(_dot_from(path, bits, packed, (r + i) * plane, plane, done,
                                                                  xq, x0))
                    out[t + k, r + i] = np.float32(0) + (scale[r + i, 0] * xs[t + k, 0]) * (
                        np.float32(isum[k * batch + i]) - zero[r + i, 0] * np.float32(qs[t + k, 0]))
            t += tile
        r += nrows
    return r


LANE_ROWS = 16   # rows a _rows_lanes call: their bytes (8 KiB of a 1024-column INT4 row) stay in L1 for the next token


@njit_exact
def _lane_rows(path, bits, packed, scale, zero, xq, stride, xs, qs, t0, t1, r0, r1, out, ngroups, group, plane):
    """_rows by the lane rule (grouped matrices whose planes are whole 32-byte blocks)."""
    totals = np.empty(LANE_ROWS, np.float32)
    flat_scale = scale.reshape(scale.size)
    for first in range(np.uint64(r0), np.uint64(r1), np.uint64(LANE_ROWS)):
        nrows = min(np.uint64(LANE_ROWS), np.uint64(r1) - first)
        for t in range(np.uint64(t0), np.uint64(t1)):
            _rows_lanes(path, bits, packed, first * ngroups * plane, plane, ngroups, group, xq, t * stride,
                        flat_scale, first * ngroups, xs[t], nrows, totals)
            for i in range(nrows):
                r = first + i
                offset = np.float32(0)
                for gi in range(ngroups):
                    offset = offset + scale[r, gi] * xs[t, gi] * zero[r, gi] * np.float32(qs[t, gi])
                out[t, r] = totals[i] - offset


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
def _quantize_row(v, g, xq, xs, qs):
    """One token: v float32 [C] -> xq int8 [Cp] (padding left as given: zeros), xs float32 [NG], qs int64 [NG]."""
    cols = v.shape[0]
    for gi in range(xs.shape[0]):
        c0, c1 = gi * g, min(cols, (gi + 1) * g)
        s = _abs_max(v[c0:c1]) / np.float32(127)
        xs[gi] = s
        qs[gi] = _quantize_group(v[c0:c1], s, xq[c0:c1]) if s > 0 else 0


@njit_exact
def quantize_activations_kernel(x, g, xq, xs, qs):
    """x float32 [T, C] -> xq int8 [T, Cp] (padding left as given: zeros), xs float32 [T, NG], qs int64 [T, NG]."""
    for t in range(x.shape[0]):
        _quantize_row(x[t], g, xq[t], xs[t], qs[t])


@njit_exact
def _quantized_activations(x, g, ngroups):
    """x float32 [T, C] -> (xq int8 [T * Cp] flat, zero-padded; xs float32 [T, NG]; qs int64 [T, NG])."""
    ntok = x.shape[0]
    xq = np.zeros((ntok, ngroups * g), np.int8)
    xs = np.empty((ntok, ngroups), np.float32)
    qs = np.empty((ntok, ngroups), np.int64)
    quantize_activations_kernel(x, g, xq, xs, qs)
    return xq.reshape(xq.size), xs, qs


@njit_exact_parallel
def qmatmul_int_kernel(path, bits, g, packed, scale, zero, x, out, nblocks):
    """out float32 [T, R] = dequantized x @ W^T on the integer path, x float32 [T, C] quantized here
    (one call from Python: no scratch arrays made there)."""
    rows, ngroups = scale.shape
    xq, xs, qs = _quantized_activations(x, g, ngroups)
    size = _block_size(rows, nblocks)
    for b in numba.prange(-(-rows // size)):
        _rows(path, bits, g, packed, scale, zero, xq, ngroups * g, xs, qs, np.int64(0), x.shape[0],
              b * size, min(rows, (b + 1) * size), out)


@njit_exact
def silu_mul(gv, uv):
    """silu(gv) * uv in float32, exp taken in float64 and rounded (edgemoe/kernels/reference.py does the same)."""
    return gv / (np.float32(1) + np.float32(np.exp(-np.float64(gv)))) * uv


@njit_exact
def gpt_oss_glu(gv, uv, alpha, limit):
    """GPT-OSS's gated unit on biased gate and up values, in float32 in torch's order
    (edgemoe/kernels/activations.py): (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha * g)),
    g = min(gate, limit); the sigmoid's exp taken in float64 and rounded, as silu_mul's."""
    g = min(gv, limit)
    u = min(max(uv, -limit), limit)
    sig = np.float32(1) / (np.float32(1) + np.float32(np.exp(-np.float64(alpha * g))))
    return (u + np.float32(1)) * (g * sig)


@njit_exact_parallel
def swiglu_int_kernel(path, bits, g, gate_p, gate_s, gate_z, up_p, up_s, up_z, xq, xs, qs,
                      dbits, dg, down_p, down_s, down_z, hg, hu, h, hq, hs, hqs, out, nblocks):
    """out [T, D] = down(silu(gate x) * (up x)), h re-quantized to int8 per token and per group of down.
    hg, hu, h: scratch [T, I]; hq: zeros [T, Ip]; hs, hqs [T, NGd]; flat packed and xq, as _rows."""
    inner = gate_s.shape[0]
    ntok = h.shape[0]
    xstride = xq.size // max(1, ntok)
    size = _block_size(inner, nblocks)
    for b in numba.prange(-(-inner // size)):  # gate and up rows of a block together: xq stays in cache
        r0, r1 = b * size, min(inner, (b + 1) * size)
        _rows(path, bits, g, gate_p, gate_s, gate_z, xq, xstride, xs, qs, np.int64(0), ntok, r0, r1, hg)
        _rows(path, bits, g, up_p, up_s, up_z, xq, xstride, xs, qs, np.int64(0), ntok, r0, r1, hu)
        for t in range(h.shape[0]):
            for r in range(r0, r1):
                h[t, r] = silu_mul(hg[t, r], hu[t, r])
    quantize_activations_kernel(h, dg, hq, hs, hqs)
    hflat = hq.reshape(hq.size)
    dim = down_s.shape[0]
    size = _block_size(dim, nblocks)
    for b in numba.prange(-(-dim // size)):
        _rows(path, dbits, dg, down_p, down_s, down_z, hflat, hq.shape[1], hs, hqs, np.int64(0), ntok,
              b * size, min(dim, (b + 1) * size), out)


# One layer's experts in one call (swiglu_experts_int_kernel). Each expert is a row of an int64
# layout table: the addresses of its nine arrays (edgemoe/kernels/views.py), then gate's (and up's)
# width, padded group size and group count, then down's, then the expert's shape (I, D), then its
# kind: SwiGLU, GPT-OSS's clamped SwiGLU with biases, whose float32 arrays' addresses follow
# (gate and up biases [I], down bias [D], and (alpha, limit) [2]; 0 for a SwiGLU expert), or an ungated
# relu expert, down(relu(up x)) (Switch Transformers), whose gate addresses are 0 and whose gate
# width, group and group count are up's (the token is quantized on them).
GATE_P, GATE_S, GATE_Z, UP_P, UP_S, UP_Z, DOWN_P, DOWN_S, DOWN_Z = range(9)
G_BITS, G_GROUP, G_NGROUPS, D_BITS, D_GROUP, D_NGROUPS, INNER, HIDDEN = range(9, 17)
KIND, GATE_BIAS, UP_BIAS, DOWN_BIAS, PARAMS = range(17, 22)
LAYOUT_COLUMNS = 22
KIND_SWIGLU, KIND_GPT_OSS, KIND_RELU = 0, 1, 2


@njit_exact
def _matrix(layout, a, first, rows, row_bytes, ngroups):
    """(packed flat uint8, scale [R, NG], zero [R, NG]) of expert a's matrix whose addresses start at `first`."""
    packed = uint8_view(layout[a, first], rows * row_bytes)
    scale = float32_view(layout[a, first + 1], rows, ngroups)
    zero = float32_view(layout[a, first + 2], rows, ngroups)
    return packed, scale, zero


@njit_exact
def _quantize_pairs(rows, starts, layout, a, group_col, xq, xs, qs):
    """Expert a's token rows [P, C] quantized on its groups (layout column group_col, group count next)."""
    g, ng = layout[a, group_col], layout[a, group_col + 1]
    for p in range(starts[a], starts[a + 1]):
        _quantize_row(rows[p], g, xq[p], xs[p, :ng], qs[p, :ng])


@njit_exact_inline
def zeroed_codes(rows, cols):
    """int8 [rows, cols] of zeros, written by a loop: in a parallel function numba makes np.zeros a
    parallel region of its own, which one token's few kilobytes do not pay for (docs/benchmarks.md,
    "Fewer parallel regions")."""
    codes = np.empty((rows, cols), np.int8)
    for r in range(rows):
        for c in range(cols):
            codes[r, c] = 0
    return codes


@njit_exact
def swiglu_experts_int_kernel(path, layout, starts, x, inner, y, nblocks):
    """Every expert of a layer on the integer path in one call: y[p] = expert a's output for pair p,
    for the pairs starts[a] <= p < starts[a + 1] of each expert a. x float32 [P, D]: each pair's
    token, gathered; y float32 [P, D]. Per pair, bit-identical to swiglu_int_kernel on that token
    (a SwiGLU expert); a GPT-OSS expert (layout column KIND) adds its biases and uses gpt_oss_glu; a
    relu expert has no gate: relu of up's rows.
    Work is spread over (expert, block of rows) so that many small experts keep every thread busy."""
    swiglu_experts_int(path, layout, starts, x, inner, y, nblocks)


@njit_exact_parallel
def swiglu_experts_int(path, layout, starts, x, inner, y, nblocks):
    """swiglu_experts_int_kernel's body, compiled once for the kernels that call it (edgemoe/kernels/
    cpu_layer.py's MoE block too): inlined, numba compiled it again inside each of them."""
    nexp = layout.shape[0]
    npairs, dim = x.shape
    xcols, hcols, xng, hng = np.int64(0), np.int64(0), np.int64(0), np.int64(0)   # the widest expert's
    for a in range(nexp):
        xcols = max(xcols, layout[a, G_GROUP] * layout[a, G_NGROUPS])
        hcols = max(hcols, layout[a, D_GROUP] * layout[a, D_NGROUPS])
        xng = max(xng, layout[a, G_NGROUPS])
        hng = max(hng, layout[a, D_NGROUPS])
    xq = zeroed_codes(npairs, xcols)   # zero padding, as quantize_activations
    xs = np.empty((npairs, xng), np.float32)
    qs = np.empty((npairs, xng), np.int64)
    hq = zeroed_codes(npairs, hcols)
    hs = np.empty((npairs, hng), np.float32)
    hqs = np.empty((npairs, hng), np.int64)
    hg = np.empty((npairs, inner), np.float32)
    hu = np.empty((npairs, inner), np.float32)
    h = np.empty((npairs, inner), np.float32)
    for a in numba.prange(nexp):
        _quantize_pairs(x, starts, layout, a, G_GROUP, xq, xs, qs)
    xflat = xq.reshape(xq.size)
    size = _block_size(nexp * inner, nblocks)
    per_expert = -(-inner // size)
    for item in numba.prange(nexp * per_expert):   # gate and up rows of a block together
        a, b = item // per_expert, item % per_expert
        r0, r1 = b * size, min(inner, (b + 1) * size)
        bits, g, ng = layout[a, G_BITS], layout[a, G_GROUP], layout[a, G_NGROUPS]
        row_bytes = ng * (g * bits // 8)
        up, us, uz = _matrix(layout, a, UP_P, inner, row_bytes, ng)
        p0, p1 = starts[a], starts[a + 1]
        _rows(path, bits, g, up, us, uz, xflat, xcols, xs, qs, p0, p1, r0, r1, hu)
        if layout[a, KIND] == KIND_RELU:
            for p in range(p0, p1):
                for r in range(r0, r1):
                    v = hu[p, r]
                    h[p, r] = np.float32(0) if v < 0 else v   # torch.relu's value (a NaN stays NaN)
            continue
        gp, gs, gz = _matrix(layout, a, GATE_P, inner, row_bytes, ng)
        _rows(path, bits, g, gp, gs, gz, xflat, xcols, xs, qs, p0, p1, r0, r1, hg)
        if layout[a, KIND] == KIND_GPT_OSS:
            _gpt_oss_hidden(layout, a, inner, hg, hu, p0, p1, r0, r1, h)
        else:
            for p in range(p0, p1):
                for r in range(r0, r1):
                    h[p, r] = silu_mul(hg[p, r], hu[p, r])
    for a in numba.prange(nexp):
        _quantize_pairs(h, starts, layout, a, D_GROUP, hq, hs, hqs)
    hflat = hq.reshape(hq.size)
    size = _block_size(nexp * dim, nblocks)
    per_expert = -(-dim // size)
    for item in numba.prange(nexp * per_expert):
        a, b = item // per_expert, item % per_expert
        bits, g, ng = layout[a, D_BITS], layout[a, D_GROUP], layout[a, D_NGROUPS]
        dp, ds, dz = _matrix(layout, a, DOWN_P, dim, ng * (g * bits // 8), ng)
        _rows(path, bits, g, dp, ds, dz, hflat, hcols, hs, hqs, starts[a], starts[a + 1],
              b * size, min(dim, (b + 1) * size), y)
        if layout[a, KIND] == KIND_GPT_OSS:
            bias = float32_view(layout[a, DOWN_BIAS], 1, dim)[0]
            for p in range(starts[a], starts[a + 1]):
                for r in range(b * size, min(dim, (b + 1) * size)):
                    y[p, r] = y[p, r] + bias[r]


@njit_exact_inline
def _gpt_oss_hidden(layout, a, inner, hg, hu, p0, p1, r0, r1, h):
    """h's rows r0..r1 of expert a's pairs p0..p1 from its gate and up outputs, by GPT-OSS's gated
    unit on them plus the expert's biases (layout columns GATE_BIAS, UP_BIAS, PARAMS)."""
    gate_bias = float32_view(layout[a, GATE_BIAS], 1, inner)[0]
    up_bias = float32_view(layout[a, UP_BIAS], 1, inner)[0]
    params = float32_view(layout[a, PARAMS], 1, 2)[0]
    for p in range(p0, p1):
        for r in range(r0, r1):
            h[p, r] = gpt_oss_glu(hg[p, r] + gate_bias[r], hu[p, r] + up_bias[r], params[0], params[1])


@njit_exact
def layout_problem(layouts, starts, npairs):
    """0 if the layout table and the pairs' offsets are consistent (one shape, ascending offsets from
    0 to npairs), else 1 (shapes differ) or 2 (offsets): the checks of ops.swiglu_experts_int, in
    one call (in numpy they cost ~6 us a layer)."""
    for a in range(1, layouts.shape[0]):
        if layouts[a, INNER] != layouts[0, INNER] or layouts[a, HIDDEN] != layouts[0, HIDDEN]:
            return 1
    if starts.shape[0] != layouts.shape[0] + 1 or starts[0] != 0 or starts[-1] != npairs:
        return 2
    for a in range(layouts.shape[0]):
        if starts[a + 1] < starts[a]:
            return 2
    return 0


@njit_exact
def weighted_sum_kernel(y, tokens, weights, out):
    """out[tokens[p]] += y[p] * weights[p], pair by pair in order: the sum a torch scatter-add of each
    expert's weighted outputs, expert by expert, gives (each product rounded, then each addition)."""
    for p in range(y.shape[0]):
        t = tokens[p]
        w = weights[p]
        for c in range(y.shape[1]):
            out[t, c] = out[t, c] + y[p, c] * w
