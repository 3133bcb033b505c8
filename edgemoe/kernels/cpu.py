"""numba CPU kernels that compute straight from packed codes (layout: edgemoe.quant.formats).

Shapes: T tokens, R rows (output channels), C columns, NG groups per row, G padded group size,
Cp = NG * G padded columns, n = 8 / bits codes per byte, P = G / n codes per plane,
D hidden, I expert hidden.

Every kernel uses  y[t, r] = sum_g scale[r, g] * (x[t, g] . codes[r, g] - zero[r, g] * sum(x[t, g])):
the inner loop is a plain dot product of float32 activations with codes converted to float32,
one loop per plane so that each decodes with one shift and one uint8 mask. Activations are padded
with zeros to Cp, so padding codes contribute nothing.

One token: each plane is decoded and multiplied in the same loop (_dot_bytes). Several tokens: a
chunk of a group is decoded once into a float32 scratch (CHUNK codes, L2-resident) and read by every
token's dot product, four tokens per pass (_dot4), so decoding is paid once per weight, not per token.

Reproducibility: work is split over blocks of output rows and an output is always computed by one
thread, so results do not depend on the thread count. A token alone and a token in a batch go
through different loops (inline decode vs decoded scratch, four tokens per pass); with fastmath each
loop's reduction shape is LLVM's choice for the CPU. On the AVX-512 Xeon the shapes agree and a
token's output is bit-identical alone or in any batch; on AVX2 (Zen 3, 16 vector registers) the
four-token loop gets another shape and results differ by rounding (tests/test_kernels.py bounds it).
The runtime never relies on it: the latency model picks the kernel by token count anyway.
"""

from __future__ import annotations

import numba
import numpy as np

from ._jit import njit_exact, njit_exact_parallel, njit_parallel, njit_serial

CHUNK = 65536  # codes decoded at once in the multi-token path: at most 256 KiB of scratch (L2)
BLOCKS_PER_THREAD = 8  # row blocks per thread: few scratch allocations, still balanced
U0, U1, U2, U3, U4 = (np.uint64(i) for i in range(5))  # index constants that keep uint64 arithmetic


@njit_exact
def _add(a, b):
    """a + b that LLVM may not reassociate (no fastmath flags survive inlining): fixes the order."""
    return a + b


@njit_serial
def _dot_bytes(bits, packed, r, off, nb, x, c0, plane, acc):
    """acc + sum of code * x[0, column] over the codes of bytes packed[r, off : off + nb].

    Plane j of byte k is column c0 + j * plane + k. Planes are added to acc one by one, in the order
    _group_dots adds them, so that a token gives the same bits alone or in a batch.
    """
    if bits == 8:
        a0 = np.float32(0)
        for k in range(nb):
            a0 += x[0, c0 + k] * np.float32(packed[r, off + k])
        return _add(acc, a0)
    c1 = c0 + plane
    if bits == 4:
        a0 = np.float32(0)
        a1 = np.float32(0)
        for k in range(nb):
            a0 += x[0, c0 + k] * np.float32(packed[r, off + k] & np.uint8(15))
        for k in range(nb):
            a1 += x[0, c1 + k] * np.float32(packed[r, off + k] >> np.uint8(4))
        return _add(_add(acc, a0), a1)
    c2 = c1 + plane
    c3 = c2 + plane
    a0 = np.float32(0)
    a1 = np.float32(0)
    a2 = np.float32(0)
    a3 = np.float32(0)
    for k in range(nb):
        a0 += x[0, c0 + k] * np.float32(packed[r, off + k] & np.uint8(3))
    for k in range(nb):
        a1 += x[0, c1 + k] * np.float32((packed[r, off + k] >> np.uint8(2)) & np.uint8(3))
    for k in range(nb):
        a2 += x[0, c2 + k] * np.float32((packed[r, off + k] >> np.uint8(4)) & np.uint8(3))
    for k in range(nb):
        a3 += x[0, c3 + k] * np.float32(packed[r, off + k] >> np.uint8(6))
    return _add(_add(_add(_add(acc, a0), a1), a2), a3)


@njit_serial
def _decode_bytes(bits, packed, r, off, nb, buf):
    """Codes of bytes packed[r, off : off + nb] as float32: plane j of byte k goes to buf[j * nb + k]."""
    if bits == 8:
        for k in range(nb):
            buf[k] = np.float32(packed[r, off + k])
    elif bits == 4:
        for k in range(nb):
            buf[k] = np.float32(packed[r, off + k] & np.uint8(15))
        for k in range(nb):
            buf[nb + k] = np.float32(packed[r, off + k] >> np.uint8(4))
    else:
        for k in range(nb):
            buf[k] = np.float32(packed[r, off + k] & np.uint8(3))
        for k in range(nb):
            buf[nb + k] = np.float32((packed[r, off + k] >> np.uint8(2)) & np.uint8(3))
        for k in range(nb):
            buf[2 * nb + k] = np.float32((packed[r, off + k] >> np.uint8(4)) & np.uint8(3))
        for k in range(nb):
            buf[3 * nb + k] = np.float32(packed[r, off + k] >> np.uint8(6))


@njit_serial
def _dot(buf, b0, x, t, c0, nb):
    acc = np.float32(0)
    for k in range(nb):
        acc += buf[b0 + k] * x[t, c0 + k]
    return acc


@njit_serial
def _dot4(buf, b0, x, t, c0, nb):
    """Tokens t .. t+3 against one decoded slice: each load of buf feeds four FMAs."""
    t1, t2, t3 = t + U1, t + U2, t + U3
    a0 = np.float32(0)
    a1 = np.float32(0)
    a2 = np.float32(0)
    a3 = np.float32(0)
    for k in range(nb):
        w = buf[b0 + k]
        a0 += w * x[t, c0 + k]
        a1 += w * x[t1, c0 + k]
        a2 += w * x[t2, c0 + k]
        a3 += w * x[t3, c0 + k]
    return a0, a1, a2, a3


@njit_serial
def _group_dots(bits, g, packed, r, goff, xoff, x, buf, d):
    """d[t] = x[t, xoff : xoff + g] . codes of the group at bytes packed[r, goff:], every token t.

    All offsets are uint64: an unsigned index needs no negative-index wraparound (which would stop
    LLVM from vectorizing) and, unlike a slice, creates no array view (whose reference counting
    costs atomic operations on a count shared by both threads).
    """
    ntok = np.uint64(x.shape[0])
    n = np.uint64(8 // bits)
    plane = np.uint64(g) // n
    step = np.uint64(CHUNK) // n
    for t in range(ntok):
        d[t] = 0
    b0 = U0
    while b0 < plane:  # a plane has one code per byte of the group
        nb = min(step, plane - b0)
        if ntok == U1:
            d[0] = _dot_bytes(bits, packed, r, goff + b0, nb, x, xoff + b0, plane, d[0])
        else:
            _decode_bytes(bits, packed, r, goff + b0, nb, buf)
            for j in range(n):
                c0 = xoff + j * plane + b0
                t = U0
                while t + U4 <= ntok:
                    a0, a1, a2, a3 = _dot4(buf, j * nb, x, t, c0, nb)
                    d[t] = _add(d[t], a0)
                    d[t + U1] = _add(d[t + U1], a1)
                    d[t + U2] = _add(d[t + U2], a2)
                    d[t + U3] = _add(d[t + U3], a3)
                    t += U4
                while t < ntok:
                    d[t] = _add(d[t], _dot(buf, j * nb, x, t, c0, nb))
                    t += U1
        b0 += step


@njit_serial
def _rows(bits, g, packed, scale, zero, x, xsum, r0, r1, out, buf, d):
    """out[t, r] for rows r0 <= r < r1; x float32 [T, Cp] zero-padded, xsum [T, NG] its group sums."""
    ntok = x.shape[0]
    gbytes = np.uint64(g * bits // 8)
    for r in range(np.uint64(r0), np.uint64(r1)):
        for t in range(ntok):
            out[t, r] = 0
        for gi in range(np.uint64(scale.shape[1])):
            _group_dots(bits, g, packed, r, gi * gbytes, gi * np.uint64(g), x, buf, d)
            s = scale[r, gi]
            z = zero[r, gi]
            for t in range(ntok):
                out[t, r] += s * (d[t] - z * xsum[t, gi])


def row_blocks() -> int:
    """How many row blocks the kernels split their rows into (read here: numba cannot cache it)."""
    return numba.get_num_threads() * BLOCKS_PER_THREAD


@njit_serial
def _scratch(g, ntok):
    """The multi-token path's decoded-codes buffer: one chunk of a group (none for one token)."""
    return np.empty(min(CHUNK, g) if ntok > 1 else 0, np.float32)


ROW_ALIGN = 16   # a block's rows: a multiple of the integer kernels' largest batch of rows (cpu_int)


@njit_serial
def _block_size(rows, nblocks):
    """Rows per block so that at most nblocks blocks cover rows, rounded up to ROW_ALIGN rows so that
    the integer kernels' batches fit whole blocks (more rows a block, never more blocks)."""
    size = -(-rows // min(rows, nblocks))
    return -(-size // ROW_ALIGN) * ROW_ALIGN


@njit_parallel
def qmatmul_kernel(bits, g, packed, scale, zero, x, xsum, out, nblocks):
    """out float32 [T, R] = x [T, Cp] @ W^T, W the dequantized [R, Cp] weight."""
    rows = packed.shape[0]
    size = _block_size(rows, nblocks)
    for b in numba.prange(-(-rows // size)):
        buf = _scratch(g, x.shape[0])
        d = np.empty(x.shape[0], np.float32)
        _rows(bits, g, packed, scale, zero, x, xsum, b * size, min(rows, (b + 1) * size), out, buf, d)


@njit_parallel
def swiglu_kernel(bits, g, gate_p, gate_s, gate_z, up_p, up_s, up_z, x, xsum,
                  dbits, dg, down_p, down_s, down_z, hg, hu, h, hsum, out, nblocks):
    """out [T, D] = down(silu(gate x) * (up x)). hg, hu: scratch [T, I]; h: zeros [T, Ip]; hsum [T, NGd]."""
    inner = gate_p.shape[0]
    size = _block_size(inner, nblocks)
    for b in numba.prange(-(-inner // size)):  # gate and up rows of a block together: x stays in cache
        buf = _scratch(g, x.shape[0])
        d = np.empty(x.shape[0], np.float32)
        r0, r1 = b * size, min(inner, (b + 1) * size)
        _rows(bits, g, gate_p, gate_s, gate_z, x, xsum, r0, r1, hg, buf, d)
        _rows(bits, g, up_p, up_s, up_z, x, xsum, r0, r1, hu, buf, d)
        for t in range(x.shape[0]):
            for r in range(r0, r1):
                gv = hg[t, r]
                h[t, r] = gv / (np.float32(1) + np.exp(-gv)) * hu[t, r]
    for t in range(h.shape[0]):
        for gi in range(hsum.shape[1]):
            hsum[t, gi] = _sum(h[t, gi * dg:(gi + 1) * dg])
    dim = down_p.shape[0]
    size = _block_size(dim, nblocks)
    for b in numba.prange(-(-dim // size)):
        buf = _scratch(dg, h.shape[0])
        d = np.empty(h.shape[0], np.float32)
        _rows(dbits, dg, down_p, down_s, down_z, h, hsum, b * size, min(dim, (b + 1) * size), out, buf, d)


@njit_serial
def _sum(a):
    acc = np.float32(0)
    for k in range(a.shape[0]):
        acc += a[k]
    return acc


@njit_exact
def _decode_row(bits, g, prow, srow, zrow, dst):
    """dst[c] = (code[c] - zero) * scale for the len(dst) real columns of one row (padding skipped)."""
    cols = dst.shape[0]
    n = 8 // bits
    plane = g // n
    mask = np.uint8((1 << bits) - 1)
    for gi in range(srow.shape[0]):
        s = srow[gi]
        z = zrow[gi]
        pg = prow[gi * plane:(gi + 1) * plane]  # a group has one byte per code of a plane
        for j in range(n):
            c0 = gi * g + j * plane
            shift = np.uint8(j * bits)
            seg = dst[c0:min(cols, c0 + plane)]  # empty for planes wholly in the padding
            for k in range(seg.shape[0]):
                seg[k] = (np.float32((pg[k] >> shift) & mask) - z) * s


@njit_exact_parallel
def dequantize_f32_kernel(bits, g, packed, scale, zero, out):
    for r in numba.prange(packed.shape[0]):
        _decode_row(bits, g, packed[r], scale[r], zero[r], out[r])


@njit_exact_parallel
def dequantize_bf16_kernel(bits, g, packed, scale, zero, out, nblocks):
    """out uint16 [R, C]: bfloat16 bit patterns, rounded to nearest even like torch's .to(bfloat16)."""
    rows, cols = out.shape
    size = _block_size(rows, nblocks)
    for b in numba.prange(-(-rows // size)):
        tmp = np.empty(cols, np.float32)
        u = tmp.view(np.uint32)
        for r in range(b * size, min(rows, (b + 1) * size)):
            _decode_row(bits, g, packed[r], scale[r], zero[r], tmp)
            for c in range(cols):
                out[r, c] = np.uint16((u[c] + np.uint32(0x7FFF) + ((u[c] >> 16) & np.uint32(1))) >> 16)


@njit_parallel
def parallel_sum(a):
    """Sum of a float32 [R, C] array, rows split over threads: measures memory read bandwidth."""
    part = np.zeros(a.shape[0], np.float32)
    for i in numba.prange(a.shape[0]):
        part[i] = _sum(a[i])
    return part.sum()


@njit_serial
def rms_norm_kernel(x, weight, eps, out):
    """out[t] = weight * (x[t] * 1 / sqrt(mean(x[t]^2) + eps)) for float32 rows x [T, C], weight [C]:
    one call where torch makes five small ops (a decode step runs two to four norms a layer)."""
    cols = x.shape[1]
    for t in range(x.shape[0]):
        acc = np.float32(0)
        for c in range(cols):
            acc += x[t, c] * x[t, c]
        inv = np.float32(1) / np.sqrt(acc / np.float32(cols) + eps)
        for c in range(cols):
            out[t, c] = weight[c] * (x[t, c] * inv)
