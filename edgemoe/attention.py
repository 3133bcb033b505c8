"""Query, key and value projections, one function per ModelSpec.attention kind.

Each maps a layer's normed input x [T, D] to rotated queries q [T, H, Dk], rotated keys k [T, K, Dk]
and values v [T, K, Dv], ready for the KV cache and `attend`; the model does the rest (cache, mask,
softmax, output projection) the same way for every kind.

- "gqa": grouped-query attention (Llama style), with the optional q/k/v biases, q/k RMSNorms and
  q/k/v clipping of Qwen and OLMoE. Dk = Dv = Dh.
- "mla": DeepSeek's multi-head latent attention. Keys and values come from a shared latent c [T, Ckv]
  (kv_a, then RMSNorm), expanded per head by kv_b into key dims without rotary embedding [T, H, N]
  and values [T, H, Dv]; a rope part [T, R] of the kv_a output, shared by every head, is rotated and
  appended to each head's key. Queries come from x directly (q) or through their own latent (q_a,
  RMSNorm, q_b). Dk = N + R, K = H. The cache holds the expanded keys and values (see
  docs/architecture.md for the smaller alternative of caching c and the rope part).

Shapes: T tokens, D hidden, H query heads, K kv heads, Dh head dim, N / R key dims without / with rotary
embedding, Dv value dims, Cq / Ckv query / key-value latent ranks.
"""

from __future__ import annotations

import torch

from .layers import apply_rope, deinterleave, linear, rms_norm
from .spec import ModelSpec


def gqa_qkv(spec: ModelSpec, w: dict, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _projections(spec, w, x)          # [T, H*Dh], [T, K*Dh], [T, K*Dh]
    if spec.qk_norm == "proj":
        q, k = rms_norm(q, w["q_norm"], spec.rms_norm_eps), rms_norm(k, w["k_norm"], spec.rms_norm_eps)
    if spec.clip_qkv is not None:
        q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    T = x.shape[0]
    q = q.view(T, spec.num_heads, spec.head_dim)
    k = k.view(T, spec.num_kv_heads, spec.head_dim)
    v = v.view(T, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == "head":
        q, k = rms_norm(q, w["q_norm"], spec.rms_norm_eps), rms_norm(k, w["k_norm"], spec.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _projections(spec: ModelSpec, w: dict, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v (+ their biases) from the separate matrices, or from "qkv", their rows stacked
    (edgemoe.dense.quantize_layer): one product, split."""
    if "qkv" not in w:
        return tuple(linear(x, w[role], w.get(f"{role}_bias")) for role in ("q", "k", "v"))
    kv = spec.num_kv_heads * spec.head_dim
    parts = linear(x, w["qkv"]).split([spec.num_heads * spec.head_dim, kv, kv], dim=-1)
    return tuple(p if w.get(f"{role}_bias") is None else p + w[f"{role}_bias"]
                 for p, role in zip(parts, ("q", "k", "v")))


def mla_qkv(spec: ModelSpec, w: dict, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mla = spec.attention
    T, H, N, R = x.shape[0], spec.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
    if mla.q_lora_rank:
        q_latent = rms_norm(linear(x, w["q_a"], w.get("q_a_bias")), w["q_a_norm"], spec.rms_norm_eps)
        q = linear(q_latent, w["q_b"])
    else:
        q = linear(x, w["q"])
    q_nope, q_rope = q.view(T, H, N + R).split([N, R], dim=-1)
    latent, k_rope = linear(x, w["kv_a"], w.get("kv_a_bias")).split([mla.kv_lora_rank, R], dim=-1)
    kv = linear(rms_norm(latent, w["kv_a_norm"], spec.rms_norm_eps), w["kv_b"])      # [T, H*(N+Dv)]
    k_nope, v = kv.view(T, H, N + mla.v_head_dim).split([N, mla.v_head_dim], dim=-1)
    k_rope = k_rope.view(T, 1, R)
    if spec.rotary.rope_interleave:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
    k = torch.cat((k_nope, apply_rope(k_rope, cos, sin).expand(T, H, R)), dim=-1)
    return q, k, v.contiguous()


QKV_PROJECTIONS = {"gqa": gqa_qkv, "mla": mla_qkv}
