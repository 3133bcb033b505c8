"""A T5 decoder layer's attention blocks for one token in one numba call (Switch Transformers' decode
engine: edgemoe/decode.py's EncoderDecoderEngine).

One call does, for a token's hidden state x [D] (the residual stream, updated in place):

    n = rms(x) -> qkv = n @ Wqkv^T (integer path, int8 activations)
      -> k, v written into the layer's cache at `pos` -> each head's attention over positions [0, pos],
         q.k unscaled plus the decoder's relative-position bias of the distance pos - j -> o -> x += o
      -> n = rms(x) -> q = n @ Wq_cross^T -> each head's attention over the encoder output's keys and
         values (no bias) -> o_cross -> x += o_cross
      -> h = rms(x) -> router logits = Wr @ h (float32 Wr, when the layer routes), or, in a layer with
         a dense MLP (the table's SHARED: its relu layout row), x += down(relu(up h))

The layer table is edgemoe/kernels/cpu_layer.py's, with its cross-attention columns (CROSS_Q, CROSS_O,
CROSS_NORM). The norms, projections, residuals and the dense MLP give the generic forward's bits (the
same integer rows; the relu layout row's bits are the per-matrix path's); the attention's products and
softmax differ from torch's in the last bits, so the engine's logits match the generic forward within
float32 rounding (tests/test_seq2seq_engine.py).

Shapes: D hidden, H heads, Dh head dim, L the cache's capacity, S encoder positions, C distances the
bias table holds (its last column serves every longer distance: T5's buckets end there).
"""

from __future__ import annotations

import numba
import numpy as np

from ._jit import njit_exact, njit_exact_parallel
from .cpu import _block_size
from .cpu_layer import (ATTN_NORM, CROSS_NORM, CROSS_O, CROSS_Q, DIM_D, DIM_DK, DIM_H, EXPERTS, MLP_NORM, O, QKV,
                        ROUTER, SHARED, _add_shared_expert, _dot_rows, _project, _rms_row, _scores, _softmax_rows,
                        _vector, _weighted_values)
from .views import float32_view


@njit_exact
def t5_decoder_layer_kernel(path, table, dims, eps, x, keys, values, pos, bias, cross_keys, cross_values, h, logits,
                            nblocks):
    """x float32 [D] (updated: + self-attention, + cross-attention, + the dense MLP where the layer has
    one), keys / values float32 [H, L, Dh] (position pos written), bias float32 [H, C] (the decoder's
    relative-position bias by distance), cross_keys / cross_values float32 [H, S, Dh], h float32 [D]
    (out: the MoE block's normed input), logits float32 [E] (out, if table[ROUTER]). See the module
    docstring."""
    dim, heads, dh = dims[DIM_D], dims[DIM_H], dims[DIM_DK]
    inner = heads * dh
    normed = np.empty(dim, np.float32)
    _rms_row(x, _vector(table[ATTN_NORM], dim), eps, normed)
    qkv = _project(path, table, QKV, normed, 3 * inner, nblocks)
    q = np.empty((heads, dh), np.float32)
    for hd in range(heads):
        for d in range(dh):
            q[hd, d] = qkv[hd * dh + d]
            keys[hd, pos, d] = qkv[inner + hd * dh + d]
            values[hd, pos, d] = qkv[2 * inner + hd * dh + d]
    _add_output(path, table, O, _attention(q, keys, values, pos + 1, bias, pos), x, nblocks)
    _rms_row(x, _vector(table[CROSS_NORM], dim), eps, normed)
    q = _project(path, table, CROSS_Q, normed, inner, nblocks).reshape((heads, dh))
    _add_output(path, table, CROSS_O, _attention(q, cross_keys, cross_values, cross_keys.shape[1], bias, -1), x,
                nblocks)
    _rms_row(x, _vector(table[MLP_NORM], dim), eps, h)
    _router_or_dense_mlp(path, table, dim, x, h, logits, nblocks)


@njit_exact_parallel
def _attention(q, keys, values, length, bias, pos):
    """Each head's softmax(q . k + bias) @ v over positions [0, length) of keys / values [H, L, Dh] ->
    [H * Dh]; bias[hd, min(pos - j, C - 1)] is added where pos >= 0 (self-attention), nothing where
    pos < 0 (cross-attention)."""
    heads, dh = q.shape
    attended = np.empty((heads, dh), np.float32)
    span = bias.shape[1]
    no_sinks = np.empty(1, np.float32)   # not read
    for hd in numba.prange(heads):
        scores = np.empty((1, length), np.float32)
        _scores(q[hd:hd + 1], keys[hd], 0, length, np.float32(1), scores)
        if pos >= 0:
            for j in range(length):
                scores[0, j] = scores[0, j] + bias[hd, min(pos - j, span - 1)]
        _softmax_rows(scores, length, no_sinks, False)
        _weighted_values(scores, values[hd], 0, length, attended[hd:hd + 1])
    return attended.reshape(heads * dh)


@njit_exact
def _add_output(path, table, m, attended, x, nblocks):
    """x += attended @ W^T of the table's matrix m (an attention block's output projection)."""
    o = _project(path, table, m, attended, x.shape[0], nblocks)
    for c in range(x.shape[0]):
        x[c] = x[c] + o[c]


@njit_exact_parallel
def _router_or_dense_mlp(path, table, dim, x, h, logits, nblocks):
    """The router's logits of h (a routed layer), or x += the dense relu MLP of h (table[SHARED]: its
    layout row; 0 + y, then x + that, as the generic forward's x + mlp(h))."""
    if table[ROUTER] != 0:
        experts = table[EXPERTS]
        router = float32_view(table[ROUTER], experts, dim)
        size = _block_size(experts, nblocks)
        for b in numba.prange(-(-experts // size)):
            _dot_rows(router, h, logits, b * size, min(experts, (b + 1) * size))
    elif table[SHARED] != 0:
        out = np.empty(dim, np.float32)
        for c in range(dim):
            out[c] = 0
        _add_shared_expert(path, table, h, out, nblocks)
        for c in range(dim):
            x[c] = x[c] + out[c]
