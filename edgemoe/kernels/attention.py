"""One query's attention over a KV cache in one numba call (a decode step of grouped-query attention).

Shapes: H query heads, K kv heads (H a multiple of K), Dk key dims, Dv value dims, L cached positions
before this one, C the cache's capacity (C > L).

one_query_attention_kernel(q [H, Dk], k [K, Dk], v [K, Dv], kcache [K, C, Dk], vcache [K, C, Dv],
length L, scale, out [H * Dv]): writes k and v at position L of the caches, then for each query head
h (kv head h // (H / K)) the softmax over positions 0..L of scale * q[h] . keys, and out[h] the
values weighted by it. The torch path (edgemoe.layers.attend_one: a batched product, softmax, a
batched product) computes the same; this one replaces its dozen small torch ops and the cache's two
slice assignments by one call. float32 throughout; the softmax subtracts the row's maximum.
"""

from __future__ import annotations

import numpy as np

from ._jit import njit_serial


@njit_serial
def one_query_attention_kernel(q, k, v, kcache, vcache, length, scale, out):
    heads, kv_heads = q.shape[0], k.shape[0]
    group = heads // kv_heads
    dk, dv = q.shape[1], v.shape[1]
    positions = length + 1
    kcache[:, length, :] = k
    vcache[:, length, :] = v
    scores = np.empty(positions, np.float32)
    for h in range(heads):
        g = h // group
        top = np.float32(-np.inf)
        for j in range(positions):
            acc = np.float32(0)
            for d in range(dk):
                acc += q[h, d] * kcache[g, j, d]
            scores[j] = acc * scale
            top = max(top, scores[j])
        total = np.float32(0)
        for j in range(positions):
            scores[j] = np.exp(scores[j] - top)
            total += scores[j]
        base = h * dv
        for d in range(dv):
            out[base + d] = 0
        for j in range(positions):
            p = scores[j] / total
            for d in range(dv):
                out[base + d] += p * vcache[g, j, d]
