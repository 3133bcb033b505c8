"""The dense math of a decoder layer: RMSNorm / LayerNorm, rotary embeddings, attention over a KV cache
(with optional attention sinks), SwiGLU, routing (the router logits here; the choice of experts by
ModelSpec.routing, a Router its architecture file declares: edgemoe/models/). Plain functions on
tensors, inference only.

Shapes: T tokens in the step (all sequences, flattened), D hidden, H query heads, K kv heads, Dh head dim
(Dk key, Dv value dims when they differ), S tokens of one sequence in the step, L cached length of that
sequence, E experts, A active per token.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .dense import QuantizedLinear
from .kernels.cpu import rms_norm_kernel
from .models.common import softmax_topk


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] @ weight [R, C]^T (+ bias) -> [T, R] in x's dtype, multiplied in the weight's dtype
    (a bfloat16 matrix is read at half the bytes of a float32 copy, and torch's bfloat16 GEMM
    accumulates in float32; its output is rounded to bfloat16); activations stay float32.
    weight may be a QuantizedLinear (edgemoe.dense), which multiplies itself."""
    if isinstance(weight, QuantizedLinear):
        y = weight(x).to(x.dtype)
        return y if bias is None else y + bias
    if x.dtype != weight.dtype:
        y = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. float32 rows on the CPU take one numba call
    (kernels.cpu.rms_norm_kernel), anything else the torch ops."""
    if (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.dim() == 1
            and x.shape[-1] == weight.shape[0] and x.is_contiguous()):
        rows = x.numpy().reshape(-1, x.shape[-1])
        out = np.empty_like(rows)
        rms_norm_kernel(rows, weight.numpy(), eps, out)
        return torch.from_numpy(out).view(x.shape)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, weight.shape, weight, bias, eps)


@functools.cache   # a decode step asks for one position's table: the frequencies are the same every time
def _theta_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    with torch.inference_mode(False):   # a normal tensor, usable in and out of inference mode
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, inv_freq: tuple[float, ...] | None = None,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, Dh] for the given absolute positions [T] (half-split layout, as Llama/HF), from
    theta's frequencies or the given (scaled) ones [Dh/2], times `scale`."""
    inv_freq = _theta_frequencies(head_dim, theta) if inv_freq is None else torch.as_tensor(inv_freq, dtype=torch.float32)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh] rotated by per-token cos/sin [T, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Reorder the last dim from pairs (x0, x1), (x2, x3), ... to (x0, x2, ..., x1, x3, ...), so that the
    half-split apply_rope turns the pairs DeepSeek's interleaved layout rotates together. Queries and
    keys get the same permutation, so their dot products are those of the interleaved rotation."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def attention_mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor | None:
    """Boolean [S, L] mask (True = may attend): causal, and within `window` positions if given.
    None when every query sees every key (a decode step without a window)."""
    if q_pos.numel() == 1 and window is None:
        return None
    k_pos = torch.arange(kv_len)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


# Several queries' attention (a prompt chunk) holds their scores whole: with a mask, SDPA on the CPU
# computes them in float32 and keeps two to five [H, S, L] arrays at once, and with fewer kv heads
# than query heads it first widens the keys and values to every query head (measured above the level
# before, 16 query heads of 64 dims over 4 kv heads: 338 MiB for 512 queries against 4,096 positions,
# 3,291 MiB against 40,960). Where that would pass ATTENTION_BLOCK_BYTES, attend() takes one kv head
# at a time, its query heads folded into rows over its keys and values as they lie, and the queries in
# blocks; each output is bit for bit the one call's (tested).
ATTENTION_BLOCK_BYTES = 64 << 20
SCORE_COPIES = 5
# Blocks keep at least this many queries: products of 1-3 rows take other kernels and round differently.
MIN_BLOCK_QUERIES = 16


def attention_peak_bytes(heads: int, kv_heads: int, key_dim: int, queries: int, keys: int) -> int:
    """The most attend() holds at once for `queries` rows of `heads` heads against `keys` positions
    of `kv_heads` heads of `key_dim` (a latent cache's values are a slice of its keys)."""
    whole = _one_call_bytes(heads, kv_heads, key_dim, queries, keys)
    if whole <= ATTENTION_BLOCK_BYTES:
        return whole
    per_call = _heads_per_call(heads, kv_heads)
    return SCORE_COPIES * 4 * per_call * _query_block(per_call, queries, keys) * keys


def _one_call_bytes(heads: int, kv_heads: int, key_dim: int, queries: int, keys: int) -> int:
    widened = 4 * heads * keys * 2 * key_dim if kv_heads < heads else 0
    return SCORE_COPIES * 4 * heads * queries * keys + widened


def _heads_per_call(heads: int, kv_heads: int) -> int:
    """Query heads a blocked call takes: a kv head's group (none widened), or all where each query
    head has its own kv head (nothing to widen; a call per head would round differently)."""
    return heads if kv_heads == heads else heads // kv_heads


def _query_block(heads: int, queries: int, keys: int) -> int:
    """Queries a call of `heads` heads takes at once: equal blocks (no small last one) whose scores fit
    ATTENTION_BLOCK_BYTES, at least MIN_BLOCK_QUERIES."""
    rows = max(MIN_BLOCK_QUERIES, ATTENTION_BLOCK_BYTES // (SCORE_COPIES * 4 * heads * keys))
    blocks = -(-queries // rows)
    return -(-queries // blocks)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [S, H, Dk], k [K, L, Dk], v [K, L, Dv] -> [S, H*Dv] (grouped-query attention; scale None =
    1/sqrt(Dk)); sinks [H]: a per-head logit that joins each softmax and is dropped after it. mask:
    [S, L] or [H, S, L], True (or 0) where a query sees a key. Large ones go by kv head and block of
    queries (ATTENTION_BLOCK_BYTES)."""
    (S, H, Dk), (K, L) = q.shape, k.shape[:2]
    if _one_call_bytes(H, K, Dk, S, L) <= ATTENTION_BLOCK_BYTES:
        return _attend(q, k, v, mask, scale, sinks)
    group, Dv = _heads_per_call(H, K), v.shape[-1]
    rows = _query_block(group, S, L)
    out = torch.empty(S, H, Dv, dtype=q.dtype)
    for g in range(H // group):
        heads = slice(g * group, (g + 1) * group)
        for i in range(0, S, rows):
            n = min(rows, S - i)
            block = _mask_block(mask, heads, i, n)
            if K == H:                # every head in the call, over the cache as it lies
                part = _attend(q[i:i + n], k, v, block, scale, sinks).view(n, H, Dv)
            elif sinks is not None:   # a sink per head: the heads stay heads, over a view of the kv head
                part = _attend(q[i:i + n, heads], k[g:g + 1].expand(group, -1, -1),
                               v[g:g + 1].expand(group, -1, -1), block, scale, sinks[heads]).view(n, group, Dv)
            else:                     # the heads as rows: [1, group * n] queries against the kv head
                folded = q[i:i + n, heads].transpose(0, 1).reshape(1, group * n, Dk)
                part = F.scaled_dot_product_attention(folded, k[g:g + 1], v[g:g + 1],
                                                      attn_mask=_folded_mask(block, group, n, L),
                                                      scale=scale).view(group, n, Dv).transpose(0, 1)
            out[i:i + n, heads] = part
    return out.reshape(S, H * Dv)


def _mask_block(mask: torch.Tensor | None, heads: slice, start: int, n: int) -> torch.Tensor | None:
    """Queries start..start+n-1 of a [S, L] mask, or of `heads` of an [H, S, L] one."""
    if mask is None:
        return None
    return mask[heads, start:start + n] if mask.dim() == 3 else mask[start:start + n]


def _folded_mask(block: torch.Tensor | None, group: int, n: int, keys: int) -> torch.Tensor | None:
    """A block's mask for its `group` heads folded into rows ([group * n, L], head-major)."""
    if block is None:
        return None
    return block.reshape(group * n, keys) if block.dim() == 3 else block.repeat(group, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    if sinks is not None:
        return attend_with_sinks(q, k, v, mask, scale, sinks)
    if q.shape[0] == 1 and mask is None:
        return attend_one(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True,
                                         scale=scale)  # [H, S, Dv]
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query that sees every key (a decode step): q [1, H, Dk] -> [1, H*Dv]. The H/K query heads
    of each kv head multiply its keys and values in one batched product, reading the cache where it
    lies: SDPA with enable_gqa took 4x as long at 512 cached positions (docs/benchmarks.md)."""
    groups = k.shape[0]
    queries = q.reshape(groups, -1, q.shape[-1])                                # [K, H/K, Dk]
    probs = torch.softmax(torch.bmm(queries, k.transpose(1, 2)) * scale, dim=-1)   # [K, H/K, L]
    return torch.bmm(probs, v).reshape(1, -1)                                    # [1, H*Dv]


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """attend() with GPT-OSS's attention sinks, written out (SDPA has no extra softmax column): the
    sink takes its share of each query's probability mass, so the values' weights sum to below 1."""
    heads, group = q.shape[1], q.shape[1] // k.shape[0]
    keys, values = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)   # [H, L, D*]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale          # [H, S, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(heads, 1, 1).expand(heads, q.shape[0], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values).transpose(0, 1).reshape(q.shape[0], -1)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [T, D]; gate, up [F, D]; down [D, F] -> [T, D]."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router, top-k. x [T, D], router [E, D] -> (weights [T, A] float32, experts [T, A] int64)."""
    return softmax_topk(linear(x, router).float(), top_k, normalize)


def route_by_spec(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's router: x [T, D], router [E, D] (bias [E] where spec.routing.has_bias) -> (weights [T, A]
    float32, experts [T, A] int64), weights scaled by routed_scaling_factor."""
    return choose_experts(linear(x, router).float(), bias, spec)


def choose_experts(logits: torch.Tensor, bias: torch.Tensor | None, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """route_by_spec from the router's float32 logits [T, E] (the decode engine computes them in its kernel)."""
    weights, experts = spec.routing.choose(logits, bias, spec)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, experts
