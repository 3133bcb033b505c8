"""The dense math of a decoder layer: RMSNorm, rotary embeddings, attention over a KV cache, SwiGLU,
routing. Plain functions on tensors, inference only.

Shapes: T tokens in the step (all sequences, flattened), D hidden, H query heads, K kv heads, Dh head dim,
S tokens of one sequence in the step, L cached length of that sequence, E experts, A active per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] @ weight [R, C]^T (+ bias) -> [T, R] in x's dtype, multiplied in the weight's dtype
    (a bfloat16 matrix is read at half the bytes of a float32 copy, and torch's bfloat16 GEMM
    accumulates in float32; its output is rounded to bfloat16); activations stay float32."""
    if x.dtype != weight.dtype:
        y = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, Dh] for the given absolute positions [T] (half-split layout, as Llama/HF)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh] rotated by per-token cos/sin [T, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [S, H, Dh], k/v [K, L, Dh] -> [S, H*Dh] (grouped-query attention)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)  # [H, S, Dh]
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [T, D]; gate, up [F, D]; down [D, F] -> [T, D]."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router, top-k. x [T, D], router [E, D] -> (weights [T, A] float32, experts [T, A] int64)."""
    probs = torch.softmax(linear(x, router).float(), dim=-1)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts
