"""A decoder layer's attention block for one token in one numba call (the decode engine's kernel).

One call does, for a token's hidden state x [D] (the residual stream, updated in place):

    n = norm(x) -> qkv = n @ Wqkv^T (integer path, int8 activations) (+ q/k/v biases)
      -> q/k RMSNorm (per head or over the projection) -> clip -> rotary (cos/sin of the position)
      -> k, v written into the KV cache at `pos` -> attention of each query head over its kv head's
         keys [j0, pos] (sliding window; optional sink logit; a kv head's query heads together, in
         parallel over kv heads) -> o = attn @ Wo^T (+ bias)
      -> x += o -> h = norm(x) -> router logits = Wr @ h (float32 Wr, when the layer routes)

(attention_block_kernel), or, for multi-head latent attention (latent_attention_block_kernel), q
from x or through its latent (q_a, RMSNorm, q_b), the rope parts rotated (after DeepSeek's
deinterleave where the model has it), kv_a's normed latent and rotated rope key written into the
cache as the position's row, each head's query absorbed into the latent space through kv_b's key
rows, attention over the rows, each head's context through kv_b's value rows, then the same tail.
The phases are inlined functions (numba inlines their prange loops into the kernel's parallel
regions); the blocks that several kernels call (attention_block_kernel, moe_block_kernel,
cpu_int.swiglu_experts_int) are compiled functions of their own, so that each is compiled once. This is where the generic forward makes ~40 torch ops and kernel calls,
each with its Python around it.
The projections, RMSNorms, biases, clip, rotary and residual give the generic path's bits (the same
integer kernel rows, _rows; the same norm loop; elementwise float32 ops in torch's order, compiled
without fastmath). The attention's dot products and softmax, the router's products and LayerNorm
(where the layer has it) differ from torch's in the last bits (docs/architecture.md, "The decode
engine").

A layer's arrays reach the kernel as addresses in an int64 table (edgemoe/kernels/views.py), built
once per model by edgemoe/decode.py: one argument instead of twenty. Columns below; an address 0
means "absent" (no bias, no norm, no sinks, no router).

Shapes: D hidden, H query heads, K kv heads, Dk / Dv key / value dims per head, E experts,
L cached positions (the cache's capacity), R output rows of a projection; MLA: N / R key dims
without / with rotary, Ckv and Cq latent ranks.
"""

from __future__ import annotations

import numba
import numpy as np

from ._jit import njit_exact, njit_exact_inline, njit_exact_parallel, njit_serial
from .cpu import BLOCKS_PER_THREAD, _block_size, rms_norm_kernel
from .cpu_int import INNER, LAYOUT_COLUMNS, _quantize_row, _rows, swiglu_experts_int, zeroed_codes
from .kv import _float32_from_bits, narrow, widen
from .views import float32_view, like_view, uint8_view

# The layer table's columns. First its matrices, MATRIX_COLUMNS each: the addresses of the packed
# codes, scales and zeros, then width, padded group size and group count. QKV: q, k, v stacked
# (grouped-query attention) or q (multi-head latent attention: q, or q_b after q_a's latent).
QKV, O, Q_A, KV_A, KV_B = (i * 6 for i in range(5))
PACKED, SCALE, ZERO, BITS, GROUP, NGROUPS = range(6)
MATRIX_COLUMNS = 6
# Then float32 vectors (0: absent), then integers.
(ATTN_NORM, ATTN_NORM_BIAS, MLP_NORM, MLP_NORM_BIAS, Q_BIAS, K_BIAS, V_BIAS, Q_NORM, K_NORM, O_BIAS, SINKS,
 ROUTER, Q_A_NORM, Q_A_BIAS, KV_A_NORM, KV_A_BIAS, EXPERTS, WINDOW, ROUTER_BIAS) = range(30, 49)
# A shared expert (Qwen2-MoE, DeepSeek): the address of its int64 layout row [LAYOUT_COLUMNS]
# (cpu_int.swiglu_experts_int's, over the dense weights' quantized copies), and of its float32
# sigmoid gate [D] where the model gates it (Qwen2-MoE).
SHARED, SHARED_GATE = 49, 50
# A group-limited router's expert groups and the groups it keeps (the model's n_group, topk_group).
GROUPS, KEPT_GROUPS = 51, 52
# An encoder-decoder's decoder layer (edgemoe/kernels/cpu_seq2seq.py): its cross-attention's query and
# output matrices and its norm (a dense MLP's relu layout row goes in SHARED).
CROSS_Q, CROSS_O, CROSS_NORM = 53, 59, 65
TABLE_COLUMNS = 66
# The model's dimensions (an int64 array): K kv heads, Dk / Dv dims of a position's cached keys and
# values (for MLA the cache's: K = 1, Dk = Ckv + R, Dv = 0). MLA: N / R key dims without / with
# rotary, Ckv latent rank, Cq query latent rank (0: q straight from x), V value dims per head.
(DIM_D, DIM_H, DIM_K, DIM_DK, DIM_DV, DIM_QK_NORM, DIM_NORM, DIM_N, DIM_R, DIM_CKV, DIM_CQ, DIM_INTERLEAVE,
 DIM_V) = range(13)
DIMS = 13
QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_PROJ = 0, 1, 2
NORM_RMS, NORM_LAYER = 0, 1   # the layer norms: RMSNorm, or LayerNorm with a bias (Phi-3.5-MoE)
# The routers the MoE block computes: softmax then top-k (the weights renormalised or not), top-k of
# the logits plus a bias, softmaxed among themselves (GPT-OSS), sparsemixer (Phi-3.5-MoE), or
# DeepSeek's group-limited ones (grouped_kernel: V2's softmax, V3's sigmoid renormalised or not).
SOFTMAX, SOFTMAX_NORMALIZED, TOPK_SOFTMAX, SPARSEMIXER = 0, 1, 2, 3
SOFTMAX_GROUP, SIGMOID_GROUP, SIGMOID_GROUP_NORMALIZED = 4, 5, 6


@njit_exact_inline
def _vector(address, n):
    return float32_view(address, 1, n)[0]


@njit_exact_inline
def _rms_row(x, weight, eps, out):
    """RMSNorm of one row x [C] into out [C] (may be x) by kernels.cpu.rms_norm_kernel itself, eps a
    float64 as the generic path passes it: the generic path's bits, which the int8 quantization of
    the next projection's input needs (a last-bit change can move a code by one)."""
    rms_norm_kernel(x.reshape((1, x.shape[0])), weight, eps, out.reshape((1, out.shape[0])))


@njit_exact_inline
def _layer_norm_row(x, weight, bias, eps, out):
    """LayerNorm of one row: (x - mean) / sqrt(var + eps) * weight + bias, biased variance, in float32
    (F.layer_norm sums in another order: the last bits differ)."""
    cols = x.shape[0]
    mean = np.float32(0)
    for c in range(cols):
        mean += x[c]
    mean = mean / np.float32(cols)
    var = np.float32(0)
    for c in range(cols):
        d = x[c] - mean
        var += d * d
    inv = np.float32(1) / np.sqrt(var / np.float32(cols) + np.float32(eps))
    for c in range(cols):
        out[c] = (x[c] - mean) * inv * weight[c] + bias[c]


@njit_exact_inline
def _norm(kind, x, table, weight_col, bias_col, eps, out):
    """The layer's norm (table[weight_col], and table[bias_col] for LayerNorm) of x into out."""
    dim = x.shape[0]
    if kind == NORM_LAYER:
        _layer_norm_row(x, _vector(table[weight_col], dim), _vector(table[bias_col], dim), eps, out)
    else:
        _rms_row(x, _vector(table[weight_col], dim), eps, out)


@njit_exact_inline
def _add_bias(v, address):
    if address != 0:
        bias = _vector(address, v.shape[0])
        for c in range(v.shape[0]):
            v[c] = v[c] + bias[c]


@njit_exact_inline
def _norm_heads(v, address, heads, dim, per_head, eps):
    """The q or k RMSNorm in place: over each head's dims, or over the whole projection."""
    if address == 0:
        return
    if per_head:
        weight = _vector(address, dim)
        rows = v.reshape((heads, dim))   # in place: the kernel reads x[t, c] before it writes out[t, c]
        rms_norm_kernel(rows, weight, eps, rows)
    else:
        _rms_row(v, _vector(address, v.shape[0]), eps, v)


@njit_exact_inline
def _rope_heads(v, heads, dim, cos, sin):
    """apply_rope in place on `heads` heads of `dim`: x * cos + rotate_half(x) * sin, each product
    rounded, then the sum (torch's elementwise order)."""
    half = dim // 2
    for hd in range(heads):
        base = hd * dim
        first = v[base:base + half].copy()
        for i in range(half):
            second = v[base + half + i]
            v[base + i] = first[i] * cos[i] + (-second) * sin[i]
            v[base + half + i] = second * cos[half + i] + first[i] * sin[half + i]


POSITIONS = 4   # cache positions a pass over the query heads (scores) or the output (values) takes (the
                # loops below are written out for four)


@njit_serial
def _attend_group(q, keys, values, j0, j1, scale, sinks, has_sink, scores, out):
    """The G query heads of one kv head over its keys/values [j0, j1): for each head g,
    softmax(q[g] . k * scale) @ v into out[g]; sinks[g] (if has_sink) joins head g's softmax and is
    dropped after it. q [G, Dk], out [G, Dv], scores [G, j1 - j0] scratch. Each key and value row is
    read once for the whole group, not once per head: at long contexts a kv head's rows outgrow the
    core's cache (1 MiB of float32 keys and values at 2048 positions of 64 dims), and the heads would
    each read them from memory again (docs/benchmarks.md measures the difference). Positions go
    POSITIONS at a time: a head's query (scores) and output row (values) are loaded and stored once
    per POSITIONS positions instead of once per position (tools/bench_attention_block.py)."""
    _scores(q, keys, j0, j1, scale, scores)
    _softmax_rows(scores, j1 - j0, sinks, has_sink)
    _weighted_values(scores, values, j0, j1, out)


@njit_serial
def _scores(q, keys, j0, j1, scale, scores):
    """scores[g, j - j0] = q[g] . keys[j] * scale."""
    j = j0
    while j + POSITIONS <= j1:
        for g in range(q.shape[0]):
            s0 = s1 = s2 = s3 = np.float32(0)
            for d in range(q.shape[1]):
                qd = q[g, d]
                s0 += qd * widen(keys[j, d])
                s1 += qd * widen(keys[j + 1, d])
                s2 += qd * widen(keys[j + 2, d])
                s3 += qd * widen(keys[j + 3, d])
            scores[g, j - j0] = s0 * scale
            scores[g, j + 1 - j0] = s1 * scale
            scores[g, j + 2 - j0] = s2 * scale
            scores[g, j + 3 - j0] = s3 * scale
        j += POSITIONS
    for last in range(j, j1):   # the positions past the last whole POSITIONS
        for g in range(q.shape[0]):
            s = np.float32(0)
            for d in range(q.shape[1]):
                s += q[g, d] * widen(keys[last, d])
            scores[g, last - j0] = s * scale


@njit_exact_inline
def exp_nonpositive(x):
    """exp(x) for float32 x <= 0 within 2.5e-7 relative error (0 below -87.33, where float32's normal
    range ends), in float32 operations a loop vectorizes: Cephes expf's range reduction and polynomial,
    2^n from the exponent's bits. numba's np.exp is a scalar libm call per element where numba has no
    SVML (the attention block's timings before and after: docs/benchmarks.md)."""
    if x < np.float32(-87.33):
        return np.float32(0)
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)   # x - n ln 2, in two parts
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1)
    return p * _float32_from_bits(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))


@njit_serial
def _softmax_rows(scores, n, sinks, has_sink):
    """Each row g of scores[:, :n] replaced by its softmax, sinks[g] (if has_sink) taking part."""
    for g in range(scores.shape[0]):
        top = np.float32(-np.inf)
        for j in range(n):
            top = max(top, scores[g, j])
        if has_sink:
            top = max(top, sinks[g])
        total = np.float32(0)
        for j in range(n):
            e = exp_nonpositive(scores[g, j] - top)
            scores[g, j] = e
            total += e
        if has_sink:
            total += exp_nonpositive(sinks[g] - top)
        for j in range(n):
            scores[g, j] = scores[g, j] / total


@njit_serial
def _weighted_values(p, values, j0, j1, out):
    """out[g] = sum over j in [j0, j1) of p[g, j - j0] * values[j]."""
    out[:] = 0
    j = j0
    while j + POSITIONS <= j1:
        for g in range(out.shape[0]):
            p0, p1, p2, p3 = p[g, j - j0], p[g, j + 1 - j0], p[g, j + 2 - j0], p[g, j + 3 - j0]
            for d in range(out.shape[1]):
                out[g, d] += ((p0 * widen(values[j, d]) + p1 * widen(values[j + 1, d]))
                              + (p2 * widen(values[j + 2, d]) + p3 * widen(values[j + 3, d])))
        j += POSITIONS
    for last in range(j, j1):
        for g in range(out.shape[0]):
            for d in range(out.shape[1]):
                out[g, d] += p[g, last - j0] * widen(values[last, d])


@njit_serial
def _dot_rows(matrix, v, out, r0, r1):
    for r in range(r0, r1):
        s = np.float32(0)
        for c in range(v.shape[0]):
            s += matrix[r, c] * v[c]
        out[r] = s


@njit_exact_parallel
def _matrix_product(path, table, m, v, rows, nblocks):
    """v float32 [C] @ matrix m's (table[m:m + MATRIX_COLUMNS]) W^T on the integer path -> float32 [R]:
    v quantized to int8 on the matrix's groups, rows in parallel blocks (qmatmul_int_kernel's bits)."""
    bits, g, ng = table[m + BITS], table[m + GROUP], table[m + NGROUPS]
    xq = zeroed_codes(1, ng * g)[0]
    xs = np.empty((1, ng), np.float32)
    qs = np.empty((1, ng), np.int64)
    _quantize_row(v, g, xq, xs[0], qs[0])
    packed = uint8_view(table[m + PACKED], rows * ng * (g * bits // 8))
    scale = float32_view(table[m + SCALE], rows, ng)
    zero = float32_view(table[m + ZERO], rows, ng)
    out = np.empty((1, rows), np.float32)
    size = _block_size(rows, nblocks)
    for b in numba.prange(-(-rows // size)):
        _rows(path, bits, g, packed, scale, zero, xq, ng * g, xs, qs, np.int64(0), np.int64(1), b * size,
              min(rows, (b + 1) * size), out)
    return out[0]


@njit_exact_inline
def _project(path, table, m, v, rows, nblocks):
    """_matrix_product, called rather than inlined: compiled once, not once a call site (inlined, each
    site was a parallel region of its own whose module linked and optimized the integer row kernels
    again: latent attention's kernel took 52 s to compile, now 23; tools/bench_compile.py). m goes as
    a plain int64, since numba compiles a callee again for each literal argument."""
    return _matrix_product(path, table, np.int64(m), v, rows, nblocks)


@njit_exact_inline
def _gqa_qkv(path, table, dims, eps, clip, normed, cos, sin, nblocks):
    """Grouped-query attention's rotated q [H * Dk], k [K * Dk] and v [K * Dv] (attention.gqa_qkv)."""
    heads, kv_heads, dk, dv = dims[DIM_H], dims[DIM_K], dims[DIM_DK], dims[DIM_DV]
    qkv = _project(path, table, QKV, normed, (heads + kv_heads) * dk + kv_heads * dv, nblocks)
    return _gqa_rotated(table, dims, eps, clip, qkv, cos, sin)


@njit_exact_inline
def _gqa_rotated(table, dims, eps, clip, qkv, cos, sin):
    """A token's projected q, k, v (qkv [H * Dk + K * Dk + K * Dv], in place) with their biases,
    q/k norms, clip and rotary: _gqa_qkv's tail."""
    heads, kv_heads, dk = dims[DIM_H], dims[DIM_K], dims[DIM_DK]
    nq, nk = heads * dk, kv_heads * dk
    q, k, v = qkv[:nq], qkv[nq:nq + nk], qkv[nq + nk:]
    _add_bias(q, table[Q_BIAS])
    _add_bias(k, table[K_BIAS])
    _add_bias(v, table[V_BIAS])
    per_head = dims[DIM_QK_NORM] == QK_NORM_HEAD
    _norm_heads(q, table[Q_NORM], heads, dk, per_head, eps)
    _norm_heads(k, table[K_NORM], kv_heads, dk, per_head, eps)
    if clip >= 0:
        for part in (q, k, v):
            for c in range(part.shape[0]):
                part[c] = min(max(part[c], -clip), clip)
    _rope_heads(q, heads, dk, cos, sin)
    _rope_heads(k, kv_heads, dk, cos, sin)
    return q, k, v


@njit_exact_inline
def _deinterleaved(v):
    """layers.deinterleave of one head's rope part: (x0, x2, ..., x1, x3, ...)."""
    half = v.shape[0] // 2
    out = np.empty_like(v)
    for i in range(half):
        out[i] = v[2 * i]
        out[half + i] = v[2 * i + 1]
    return out


@njit_exact_inline
def _latent_qkv(path, table, dims, eps, normed, cos, sin, nblocks):
    """Multi-head latent attention's rotated queries q [H * (N + R)] and the token's cache row
    [Ckv + R]: the normed latent and the rotated rope key (attention.mla_qkv's bits)."""
    heads, n, r, ckv, cq = dims[DIM_H], dims[DIM_N], dims[DIM_R], dims[DIM_CKV], dims[DIM_CQ]
    if cq > 0:
        q_latent = _project(path, table, Q_A, normed, cq, nblocks)
        _add_bias(q_latent, table[Q_A_BIAS])
        _rms_row(q_latent, _vector(table[Q_A_NORM], cq), eps, q_latent)
        q = _project(path, table, QKV, q_latent, heads * (n + r), nblocks)
    else:
        q = _project(path, table, QKV, normed, heads * (n + r), nblocks)
    kv_a = _project(path, table, KV_A, normed, ckv + r, nblocks)
    _add_bias(kv_a, table[KV_A_BIAS])
    row = np.empty(ckv + r, np.float32)
    _rms_row(kv_a[:ckv], _vector(table[KV_A_NORM], ckv), eps, row[:ckv])
    k_rope = kv_a[ckv:].copy()
    if dims[DIM_INTERLEAVE]:
        k_rope = _deinterleaved(k_rope)
    _rope_heads(k_rope, 1, r, cos, sin)
    for d in range(r):   # loops, not slice assignments: each would be a parallel region of its own
        row[ckv + d] = k_rope[d]
    for hd in range(heads):
        base = hd * (n + r)
        if dims[DIM_INTERLEAVE]:
            q_rope = _deinterleaved(q[base + n:base + n + r])
            for d in range(r):
                q[base + n + d] = q_rope[d]
        _rope_heads(q[base + n:base + n + r], 1, r, cos, sin)
    return q, row


@njit_exact_inline
def _absorbed_queries(table, dims, q):
    """Each head's query in the latent's space, [H, Ckv + R]: W_kb,h^T q_nope,h (kv_b's key rows of
    head h times the head's query dims without rotary), then its rotated rope part as it is. Heads in
    parallel. Straight from the codes: with a_i = q_i * scale_i,g, a group's columns get
    sum_i a_i * code_i,c - sum_i a_i * zero_i,g, a multiply-add per weight and no decoded row. The
    codes and sums are sliced per plane, not indexed through one offset: so the inner loop vectorizes."""
    heads, n, r, dv, ckv = dims[DIM_H], dims[DIM_N], dims[DIM_R], dims[DIM_V], dims[DIM_CKV]
    bits, g, ng = table[KV_B + BITS], table[KV_B + GROUP], table[KV_B + NGROUPS]
    per_byte, plane = 8 // bits, g * bits // 8
    rows, row_bytes = heads * (n + dv), ng * plane
    packed = uint8_view(table[KV_B + PACKED], rows * row_bytes)
    scale = float32_view(table[KV_B + SCALE], rows, ng)
    zero = float32_view(table[KV_B + ZERO], rows, ng)
    mask = np.int32((1 << bits) - 1)
    absorbed = np.empty((heads, ckv + r), np.float32)
    for hd in numba.prange(heads):
        sums = np.empty(ng * g, np.float32)   # the padded columns too: the codes fill whole groups
        for c in range(ng * g):
            sums[c] = 0
        for gi in range(ng):
            zero_sum = np.float32(0)
            for i in range(n):
                w = hd * (n + dv) + i
                a = q[hd * (n + r) + i] * scale[w, gi]
                zero_sum += a * zero[w, gi]
                codes = packed[w * row_bytes + gi * plane:w * row_bytes + (gi + 1) * plane]
                for j in range(per_byte):
                    plane_sums = sums[gi * g + j * plane:gi * g + (j + 1) * plane]
                    shift = np.int32(j * bits)
                    for k in range(plane):
                        plane_sums[k] += a * np.float32((np.int32(codes[k]) >> shift) & mask)
            for c in range(gi * g, (gi + 1) * g):
                sums[c] -= zero_sum
        for c in range(ckv):
            absorbed[hd, c] = sums[c]
        for d in range(r):
            absorbed[hd, ckv + d] = q[hd * (n + r) + n + d]
    return absorbed


@njit_exact_inline
def _latent_attend(absorbed, rows, j0, j1, scale, ckv, nblocks):
    """The heads' absorbed queries [H, Ckv + R] over the cached rows [j0, j1) of [L, Ckv + R]: each
    head's softmax-weighted sum of the latents, [H, Ckv]. Every head reads the same rows, so the heads
    are split into one group per thread, each group reading the rows once (_attend_group)."""
    heads = absorbed.shape[0]
    context = np.empty((heads, ckv), np.float32)
    groups = min(heads, max(1, nblocks // BLOCKS_PER_THREAD))   # the threads (cpu.row_blocks)
    per_group = -(-heads // groups)
    no_sinks = np.empty(heads, np.float32)
    for b in numba.prange(groups):
        h0, h1 = b * per_group, min(heads, (b + 1) * per_group)
        if h0 < h1:
            scores = np.empty((h1 - h0, j1 - j0), np.float32)
            _attend_group(absorbed[h0:h1], rows, rows, j0, j1, scale, no_sinks[h0:h1], False, scores,
                          context[h0:h1])   # values: the rows' first Ckv dims, as context has Ckv columns
    return context


@njit_exact_parallel
def _latent_values(path, table, dims, context):
    """Each head's attention output [H * Dv]: its context [Ckv] through kv_b's value rows of head h,
    on the integer path (the context quantized to int8 on kv_b's groups, as the generic expansion
    quantizes each latent). Heads in parallel."""
    heads, n, dv = dims[DIM_H], dims[DIM_N], dims[DIM_V]
    bits, g, ng = table[KV_B + BITS], table[KV_B + GROUP], table[KV_B + NGROUPS]
    rows = heads * (n + dv)
    packed = uint8_view(table[KV_B + PACKED], rows * ng * (g * bits // 8))
    scale = float32_view(table[KV_B + SCALE], rows, ng)
    zero = float32_view(table[KV_B + ZERO], rows, ng)
    codes = zeroed_codes(heads, ng * g)
    flat = codes.reshape(heads * ng * g)
    xs = np.empty((heads, ng), np.float32)
    qs = np.empty((heads, ng), np.int64)
    out = np.empty((heads, rows), np.float32)   # head h's row: only its value rows are written
    attended = np.empty(heads * dv, np.float32)
    for hd in numba.prange(heads):
        _quantize_row(context[hd], g, codes[hd], xs[hd], qs[hd])
        first = hd * (n + dv) + n
        _rows(path, bits, g, packed, scale, zero, flat, ng * g, xs, qs, np.int64(hd), np.int64(hd + 1),
              np.int64(first), np.int64(first + dv), out)
        for d in range(dv):
            attended[hd * dv + d] = out[hd, first + d]
    return attended


@njit_exact_parallel
def _cached_attention(table, dims, scale, q, k, v, keys, values, pos):
    """Rotated q, k, v of one token: k, v into the cache at pos, then each query head's attention over
    its kv head's positions -> [H * Dv]. The part of the block that reads the cache: the only one
    numba compiles again for another cache element type."""
    heads, kv_heads, dk, dv = dims[DIM_H], dims[DIM_K], dims[DIM_DK], dims[DIM_DV]
    for kh in range(kv_heads):
        for d in range(dk):
            keys[kh, pos, d] = narrow(k[kh * dk + d], keys[kh, pos, d])
        for d in range(dv):
            values[kh, pos, d] = narrow(v[kh * dv + d], values[kh, pos, d])
    j0 = _first_position(table, pos)
    has_sink = table[SINKS] != 0
    sinks = _vector(table[SINKS], heads) if has_sink else np.empty(heads, np.float32)   # not read: no sinks
    attended = np.empty(heads * dv, np.float32)
    group = heads // kv_heads
    by_head = q.reshape(heads, dk)
    by_head_out = attended.reshape(heads, dv)
    for kh in numba.prange(kv_heads):
        scores = np.empty((group, pos + 1 - j0), np.float32)
        h0, h1 = kh * group, (kh + 1) * group
        _attend_group(by_head[h0:h1], keys[kh], values[kh], j0, pos + 1, scale, sinks[h0:h1], has_sink, scores,
                      by_head_out[h0:h1])
    return attended


@njit_exact_inline
def _first_position(table, pos):
    """The first cached position a token at pos attends to (its layer's sliding window, if any)."""
    window = table[WINDOW]
    return max(0, pos + 1 - window) if window > 0 else 0


@njit_exact_parallel
def _output(path, table, dims, eps, x, attended, h, logits, nblocks):
    """From the heads' attention outputs attended [H * Dv]: o (+ bias), x += o, h = norm(x), router
    logits (if the layer routes). Compiled once for both attention kinds and every cache element type."""
    _after_output(table, dims, eps, x, _project(path, table, O, attended, dims[DIM_D], nblocks), h, logits, nblocks)


@njit_exact_inline
def _after_output(table, dims, eps, x, o, h, logits, nblocks):
    """_output's tail from the output projection o [D] (updated: + bias)."""
    dim = dims[DIM_D]
    _add_bias(o, table[O_BIAS])
    for c in range(dim):
        x[c] = x[c] + o[c]
    _norm(dims[DIM_NORM], x, table, MLP_NORM, MLP_NORM_BIAS, eps, h)
    experts = table[EXPERTS]
    if table[ROUTER] != 0:
        router = float32_view(table[ROUTER], experts, dim)
        size = _block_size(experts, nblocks)
        for b in numba.prange(-(-experts // size)):
            _dot_rows(router, h, logits, b * size, min(experts, (b + 1) * size))


@njit_exact
def _gqa_projections(path, table, dims, eps, clip, x, cos, sin, nblocks):
    """The attention norm of x, then _gqa_qkv: rotated q, k, v."""
    normed = np.empty(dims[DIM_D], np.float32)
    _norm(dims[DIM_NORM], x, table, ATTN_NORM, ATTN_NORM_BIAS, eps, normed)
    return _gqa_qkv(path, table, dims, eps, clip, normed, cos, sin, nblocks)


@njit_exact
def attention_block_kernel(path, table, dims, eps, scale, clip, x, cos, sin, keys, values, pos, h, logits, nblocks):
    """Grouped-query attention. x float32 [D] (updated: x + attention), keys / values [K, L, Dk / Dv]
    float32, or bfloat16 as int16 bit patterns (edgemoe/kernels/kv.py; position pos written), cos / sin
    float32 [Dk] of the position, h float32 [D] (out: the MoE block's normed input), logits float32 [E]
    (out, if table[ROUTER]); clip < 0: none. See the module docstring.
    Called, not inlined, by the step kernel too (decode_token_kernel): inlined, numba compiled it again
    inside it. Three compiled parts, so that another cache element type compiles only the one that
    reads the cache (_cached_attention)."""
    q, k, v = _gqa_projections(path, table, dims, eps, clip, x, cos, sin, nblocks)
    _output(path, table, dims, eps, x, _cached_attention(table, dims, scale, q, k, v, keys, values, pos), h, logits,
            nblocks)


@njit_exact_parallel
def _matrix_product_rows(path, table, m, v, rows, nblocks):
    """_matrix_product for several tokens: v float32 [T, C] -> [T, R], each token's row the bits of
    _matrix_product on it alone (its activations quantized alike, the same _rows), the matrix read
    once for all of them."""
    bits, g, ng = table[m + BITS], table[m + GROUP], table[m + NGROUPS]
    tokens = v.shape[0]
    codes = zeroed_codes(tokens, ng * g)
    xs = np.empty((tokens, ng), np.float32)
    qs = np.empty((tokens, ng), np.int64)
    for t in range(tokens):
        _quantize_row(v[t], g, codes[t], xs[t], qs[t])
    packed = uint8_view(table[m + PACKED], rows * ng * (g * bits // 8))
    scale = float32_view(table[m + SCALE], rows, ng)
    zero = float32_view(table[m + ZERO], rows, ng)
    out = np.empty((tokens, rows), np.float32)
    size = _block_size(rows, nblocks)
    for b in numba.prange(-(-rows // size)):
        _rows(path, bits, g, packed, scale, zero, codes.reshape(-1), ng * g, xs, qs, np.int64(0), np.int64(tokens),
              b * size, min(rows, (b + 1) * size), out)
    return out


@njit_exact
def attention_rows_kernel(path, table, dims, eps, scale, clip, x, cos, sin, kv, kv_like, pos, h, logits, nblocks):
    """attention_block_kernel for one token of each of T sequences at once: x float32 [T, D] (updated),
    cos / sin [T, Dk], kv int64 [T, 3] (each sequence's keys and values addresses for this layer and
    their capacity, of kv_like's element type, as decode_token_kernel's), pos int64 [T], h float32
    [T, D] and logits [T, E] out. Each row the bits of attention_block_kernel on it alone; the
    layer's matrices read once for all rows."""
    tokens, dim = x.shape[0], dims[DIM_D]
    heads, kv_heads, dk, dv = dims[DIM_H], dims[DIM_K], dims[DIM_DK], dims[DIM_DV]
    normed = np.empty((tokens, dim), np.float32)
    for t in range(tokens):
        _norm(dims[DIM_NORM], x[t], table, ATTN_NORM, ATTN_NORM_BIAS, eps, normed[t])
    qkv = _matrix_product_rows(path, table, np.int64(QKV), normed, (heads + kv_heads) * dk + kv_heads * dv, nblocks)
    attended = np.empty((tokens, heads * dv), np.float32)
    for t in range(tokens):
        q, k, v = _gqa_rotated(table, dims, eps, clip, qkv[t], cos[t], sin[t])
        keys = like_view(kv[t, 0], (kv_heads, kv[t, 2], dk), kv_like)
        values = like_view(kv[t, 1], (kv_heads, kv[t, 2], dv), kv_like)
        attended[t] = _cached_attention(table, dims, scale, q, k, v, keys, values, pos[t])
    o = _matrix_product_rows(path, table, np.int64(O), attended, dim, nblocks)
    for t in range(tokens):
        _after_output(table, dims, eps, x[t], o[t], h[t], logits[t], nblocks)


@njit_exact
def latent_attention_block_kernel(path, table, dims, eps, scale, clip, x, cos, sin, keys, values, pos, h, logits,
                                  nblocks):
    """attention_block_kernel for multi-head latent attention (DeepSeek): cos / sin [R]; the cache
    holds each position's latent row, keys [1, L, Ckv + R] (values [1, L, 0]: none). The heads'
    queries absorbed into the latent space and the token's latent row (_latent_projections), the row
    into the cache at pos and attention over the rows (_cached_latent_attention, the one part another
    cache element type compiles again), each head's context through kv_b's value rows
    (_latent_values), then the output (_output). clip and values are not read: the arguments are attention_block_kernel's,
    so that the step's layers call either kind alike."""
    absorbed, row = _latent_projections(path, table, dims, eps, x, cos, sin, nblocks)
    context = _cached_latent_attention(absorbed, row, keys, pos, _first_position(table, pos), scale, dims[DIM_CKV],
                                       nblocks)
    _output(path, table, dims, eps, x, _latent_values(path, table, dims, context), h, logits, nblocks)


@njit_exact_parallel
def _latent_projections(path, table, dims, eps, x, cos, sin, nblocks):
    """The attention norm of x, _latent_qkv, the queries absorbed: (absorbed [H, Ckv + R], row [Ckv + R])."""
    normed = np.empty(dims[DIM_D], np.float32)
    _norm(dims[DIM_NORM], x, table, ATTN_NORM, ATTN_NORM_BIAS, eps, normed)
    q, row = _latent_qkv(path, table, dims, eps, normed, cos, sin, nblocks)
    return _absorbed_queries(table, dims, q), row


@njit_exact_parallel
def _cached_latent_attention(absorbed, row, keys, pos, j0, scale, ckv, nblocks):
    """row into the cache's rows keys[0] at pos, then _latent_attend over [j0, pos] -> [H, Ckv]."""
    rows = keys[0]
    for d in range(row.shape[0]):
        rows[pos, d] = narrow(row[d], rows[pos, d])
    return _latent_attend(absorbed, rows, j0, pos + 1, scale, ckv, nblocks)


@njit_exact
def softmax_topk_kernel(logits, top_k, normalize, weights, experts):
    """The softmax router's choice for one token: the top_k softmax probabilities of logits [E]
    (renormalised to sum 1 if normalize) into weights float32 [A], their experts into experts int64
    [A], strongest first (ties: the lower expert)."""
    top = logits.max()
    probs = np.exp(logits - top)
    probs = probs / probs.sum()
    _take_top(np.argsort(-probs, kind="mergesort"), probs, top_k, normalize, np.float32(0), weights, experts)


@njit_exact_inline
def _take_top(order, scores, top_k, normalize, eps, weights, experts):
    """The first top_k experts of `order` into experts, their scores into weights, renormalised over
    their sum + eps if normalize."""
    total = np.float32(0)
    for a in range(top_k):
        experts[a] = order[a]
        weights[a] = scores[order[a]]
        total += weights[a]
    if normalize:
        for a in range(top_k):
            weights[a] = weights[a] / (total + eps)


@njit_exact
def topk_softmax_kernel(logits, bias, top_k, weights, experts):
    """GPT-OSS's router for one token: the top_k of logits + bias (float32 [E] each; ties: the lower
    expert) into experts int64 [A], strongest first, and their softmax among themselves into weights
    float32 [A] (exp of each less the first, over their sum)."""
    biased = logits + bias
    order = np.argsort(-biased, kind="mergesort")
    top = biased[order[0]]
    total = np.float32(0)
    for a in range(top_k):
        experts[a] = order[a]
        weights[a] = np.exp(biased[order[a]] - top)
        total += weights[a]
    for a in range(top_k):
        weights[a] = weights[a] / total


@njit_exact
def sparsemixer_kernel(logits, jitter, weights, experts):
    """Phi-3.5-MoE's sparsemixer at inference for one token (models/phimoe.py's SparseMixer): the best
    expert of logits float32 [E] (ties: the lower), then the best of the rest, into experts int64 [2];
    each one's weight, into weights float32 [2], is its softmax among the candidates (the first pick
    excluded from the second) whose relative gap to it, (best - logit) / max(|logit|, best), is at most
    2 * jitter: 1 / (sum of exp(logit - best) over them)."""
    limit = np.float32(2 * jitter)
    taken = -1
    for a in range(2):
        chosen, best = -1, np.float32(0)
        for e in range(logits.shape[0]):
            if e != taken and (chosen < 0 or logits[e] > best):
                chosen, best = e, logits[e]
        total = np.float32(0)
        for e in range(logits.shape[0]):
            if e != taken and not (best - logits[e]) / max(abs(logits[e]), best) > limit:
                total += np.exp(logits[e] - best)
        experts[a] = chosen
        weights[a] = np.float32(1) / total
        taken = chosen


@njit_exact
def grouped_kernel(logits, bias, groups, kept, sigmoid, normalize, top_k, weights, experts):
    """DeepSeek's group-limited routers for one token (models/deepseek_v2.py GroupLimitedSoftmax,
    models/deepseek_v3.py SigmoidGroup): scores = softmax(logits) (V2), or sigmoid(logits) with the
    choice steered by bias float32 [E] (V3); the E experts form `groups` groups, of which the `kept`
    ranked highest (V2: by their best score; V3: by the sum of their two best biased scores; ties:
    the lower group) stay; the top_k of their experts by (biased) score, strongest first (ties: the
    lower expert), into experts int64 [A]; their unbiased scores into weights float32 [A],
    renormalised (over their sum + 1e-20) if normalize."""
    n = logits.shape[0]
    scores = np.empty(n, np.float32)
    choice = np.empty(n, np.float32)
    if sigmoid:
        for e in range(n):
            scores[e] = np.float32(1) / (np.float32(1) + np.exp(-logits[e]))
            choice[e] = scores[e] + bias[e]
    else:
        top = logits.max()
        total = np.float32(0)
        for e in range(n):
            scores[e] = np.exp(logits[e] - top)
            total += scores[e]
        for e in range(n):
            scores[e] = scores[e] / total
            choice[e] = scores[e]
    size = n // groups
    ranks = np.empty(groups, np.float32)
    for g in range(groups):
        first = second = np.float32(-np.inf)
        for e in range(g * size, (g + 1) * size):
            if choice[e] > first:
                first, second = choice[e], first
            elif choice[e] > second:
                second = choice[e]
        ranks[g] = first + second if sigmoid else first
    masked = np.full(n, -np.inf, np.float32)
    for g in np.argsort(-ranks, kind="mergesort")[:kept]:
        for e in range(g * size, (g + 1) * size):
            masked[e] = choice[e]
    _take_top(np.argsort(-masked, kind="mergesort"), scores, top_k, normalize, np.float32(1e-20), weights, experts)


@njit_exact_inline
def _route(router, logits, table, jitter, top_k, weights, experts):
    """The router's choice (SOFTMAX, SOFTMAX_NORMALIZED, TOPK_SOFTMAX, SPARSEMIXER or a group-limited
    one) from logits float32 [E]; table: the layer's (ROUTER_BIAS: the address of the router's float32
    bias [E], 0 for none; GROUPS, KEPT_GROUPS); jitter: sparsemixer's router_jitter_eps."""
    bias = table[ROUTER_BIAS]
    if router == SPARSEMIXER:
        sparsemixer_kernel(logits, jitter, weights, experts)
    elif router == TOPK_SOFTMAX:
        b = _vector(bias, logits.shape[0]) if bias != 0 else np.zeros(logits.shape[0], np.float32)
        topk_softmax_kernel(logits, b, top_k, weights, experts)
    elif router >= SOFTMAX_GROUP:
        b = _vector(bias, logits.shape[0]) if bias != 0 else np.zeros(logits.shape[0], np.float32)
        grouped_kernel(logits, b, table[GROUPS], table[KEPT_GROUPS], router != SOFTMAX_GROUP,
                       router == SIGMOID_GROUP_NORMALIZED, top_k, weights, experts)
    else:
        softmax_topk_kernel(logits, top_k, router == SOFTMAX_NORMALIZED, weights, experts)


@njit_exact_parallel
def moe_block_kernel(path, layouts, h, logits, top_k, router, table, jitter, scaling, replayed, x, weights, experts,
                     nblocks):
    """A one-token MoE block whose experts are all resident, on the integer path, in one call: the
    router's choice from logits float32 [E] (router SOFTMAX, SOFTMAX_NORMALIZED, TOPK_SOFTMAX with
    the layer table's ROUTER_BIAS the address of its float32 bias [E] or 0, or SPARSEMIXER with its
    jitter: weights float32 [A] and experts int64 [A] out, strongest first, times scaling (the
    float32 routed_scaling_factor); replayed: weights and experts are given as they are, a replayed
    trace's choice, an expert possibly twice), the chosen experts on h
    float32 [D] (layouts int64 [E, LAYOUT_COLUMNS], row e expert e's, SwiGLU or GPT-OSS's:
    cpu_int.swiglu_experts_int), and their outputs times their weights added up in ascending expert
    order, then the table's shared expert (shared_expert_kernel), then into x float32 [D] in place.
    The bits of the generic MoE block on the same choice (edgemoe.experts.ExpertBatches orders a
    step's pairs by expert; edgemoe.quantized's weighted sum adds them in that order, then the
    shared expert, then the residual), where Python around each piece cost a fine-grained layer more
    than its experts' compute.
    Called, not inlined, by the step kernels too, as attention_block_kernel."""
    if not replayed:
        _route(router, logits, table, jitter, top_k, weights, experts)
        if scaling != 1:   # as layers.choose_experts scales a float32 tensor
            for a in range(top_k):
                weights[a] = weights[a] * scaling
    order = np.argsort(experts, kind="mergesort")
    dim, columns = h.shape[0], layouts.shape[1]
    # Written as loops: in a parallel function numba makes each array expression (a slice copied,
    # np.zeros) a parallel region of its own, 2 * top_k + 1 a layer here (docs/benchmarks.md).
    chosen = np.empty((top_k, columns), np.int64)
    rows = np.empty((top_k, dim), np.float32)
    starts = np.empty(top_k + 1, np.int64)
    for a in range(top_k):
        expert = experts[order[a]]
        for c in range(columns):
            chosen[a, c] = layouts[expert, c]
        for c in range(dim):
            rows[a, c] = h[c]
        starts[a] = a
    starts[top_k] = top_k
    y = np.empty((top_k, dim), np.float32)
    swiglu_experts_int(path, chosen, starts, rows, layouts[0, INNER], y, nblocks)
    out = np.empty(dim, np.float32)
    for c in range(dim):
        out[c] = 0
    for a in range(top_k):
        w = weights[order[a]]
        for c in range(dim):
            out[c] = out[c] + y[a, c] * w
    _add_shared_expert(path, table, h, out, nblocks)
    for c in range(dim):
        x[c] = x[c] + out[c]


@njit_exact
def shared_expert_kernel(path, table, h, out, nblocks):
    """out float32 [D] += the layer's shared expert on one token's h float32 [D] (table[SHARED]; nothing
    where it is 0), times sigmoid(table[SHARED_GATE] . h) where the model gates it: what the MoE block
    kernels add, for the generic MoE block to add the same bits."""
    _add_shared_expert(path, table, h, out, nblocks)


@njit_exact_inline
def _add_shared_expert(path, table, h, out, nblocks):
    if table[SHARED] == 0:
        return
    layout = like_view(table[SHARED], (1, LAYOUT_COLUMNS), table)
    dim = h.shape[0]
    rows = np.empty((1, dim), np.float32)
    for c in range(dim):
        rows[0, c] = h[c]
    starts = np.empty(2, np.int64)
    starts[0], starts[1] = 0, 1
    y = np.empty((1, dim), np.float32)
    swiglu_experts_int(path, layout, starts, rows, layout[0, INNER], y, nblocks)
    gate = np.float32(1)
    if table[SHARED_GATE] != 0:
        g = _vector(table[SHARED_GATE], dim)
        z = np.float32(0)
        for c in range(dim):
            z += g[c] * h[c]
        gate = np.float32(1) / (np.float32(1) + np.exp(-z))
    for c in range(dim):
        out[c] = out[c] + y[0, c] * gate


@njit_exact
def decode_token_kernel(path, tables, dims, eps, scale, clip, x, cos, sin, kv, kv_like, pos, layouts, top_k,
                        router, jitter, scaling, replayed, hs, weights, experts, nblocks):
    """One token through consecutive decoder layers in one call (a model's last layers, from the decode
    engine's step_start), each grouped-query attention then a MoE block that moe_block_kernel computes:
    per layer l, attention_block_kernel with tables[l] (int64 [L, TABLE_COLUMNS]) and the layer's
    cache, then moe_block_kernel with layouts[l] (int64 [L, E, LAYOUT_COLUMNS]). x float32 [D]: the
    first layer's input in, the last layer's output out. kv int64 [L, 3]: each layer's keys and
    values addresses and its cache capacity, both [K, capacity, Dk / Dv] of kv_like's element type
    (the layer-0 keys array: float32, or int16 bit patterns of bfloat16). Out: hs float32 [L, D]
    (each MoE block's input), weights float32 [L, A] and experts int64 [L, A] (each router's choice,
    strongest first, by `router` as in moe_block_kernel with the layer's table's ROUTER_BIAS, jitter
    and scaling; replayed: given, not chosen).
    The bits of the two kernels called layer by layer."""
    _token_layers(attention_block_kernel, path, tables, dims, eps, scale, clip, x, cos, sin, kv, kv_like, pos, layouts,
                  top_k, router, jitter, scaling, replayed, hs, weights, experts, nblocks)


@njit_exact
def decode_latent_token_kernel(path, tables, dims, eps, scale, clip, x, cos, sin, kv, kv_like, pos, layouts, top_k,
                               router, jitter, scaling, replayed, hs, weights, experts, nblocks):
    """decode_token_kernel for layers of multi-head latent attention (latent_attention_block_kernel's,
    cos / sin [R]; kv's caches [1, capacity, Ckv + R] and [1, capacity, 0]; clip not read) then a MoE
    block: a kernel of its own, so that a model of the other kind never compiles this block."""
    _token_layers(latent_attention_block_kernel, path, tables, dims, eps, scale, clip, x, cos, sin, kv, kv_like, pos,
                  layouts, top_k, router, jitter, scaling, replayed, hs, weights, experts, nblocks)


@njit_exact_inline
def _token_layers(attention_block, path, tables, dims, eps, scale, clip, x, cos, sin, kv, kv_like, pos, layouts,
                  top_k, router, jitter, scaling, replayed, hs, weights, experts, nblocks):
    """The step kernels' loop over their layers, with the attention kind's block function (a compiled
    function of its own, called: the kernel of the other kind never compiles it)."""
    heads, dk, dv = dims[DIM_K], dims[DIM_DK], dims[DIM_DV]
    logits = np.empty(layouts.shape[1], np.float32)
    for l in range(tables.shape[0]):
        keys = like_view(kv[l, 0], (heads, kv[l, 2], dk), kv_like)
        values = like_view(kv[l, 1], (heads, kv[l, 2], dv), kv_like)
        attention_block(path, tables[l], dims, eps, scale, clip, x, cos, sin, keys, values, pos, hs[l], logits,
                        nblocks)
        moe_block_kernel(path, layouts[l], hs[l], logits, top_k, router, tables[l], jitter, scaling, replayed, x,
                         weights[l], experts[l], nblocks)
