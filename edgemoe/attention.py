"""Per ModelSpec.attention kind, the projections and the attention over the KV cache.

QKV_PROJECTIONS[kind](spec, w, x, cos, sin) maps a layer's normed input x [T, D] to rotated queries
q [T, H, Dk] and what the cache keeps of each token, k [T, K, Ck] and v [T, K, Cv] (spec.cache_layout);
ATTEND[kind](spec, w, q, keys, values, mask) attends the queries of a segment [S, ...] over its
cached keys [K, L, Ck] and values [K, L, Cv] -> [S, H * Dv]. The model does the rest (cache, mask,
output projection) the same way for every kind.

- "gqa": grouped-query attention (Llama style), with the optional q/k/v biases, q/k RMSNorms and
  q/k/v clipping of Qwen and OLMoE. Dk = Dv = Ck = Cv = Dh.
- "mla": DeepSeek's multi-head latent attention. Keys and values come from a shared latent c [T, Ckv]
  (kv_a, then RMSNorm), expanded per head by kv_b into key dims without rotary embedding [T, H, N]
  and values [T, H, Dv]; a rope part [T, R] of the kv_a output, shared by every head, is rotated and
  appended to each head's key. Queries come from x directly (q) or through their own latent (q_a,
  RMSNorm, q_b). Dk = N + R. The cache keeps c and the rotated rope part (K = 1, Ck = Ckv + R,
  Cv = 0); mla_attend expands them through kv_b or absorbs kv_b into the query and the output,
  whichever costs less (docs/architecture.md, "Multi-head latent attention").

Shapes: T tokens, D hidden, H query heads, K kv heads, Dh head dim, N / R key dims without / with rotary
embedding, Dv value dims, Cq / Ckv query / key-value latent ranks.
"""

from __future__ import annotations

import torch

from .dense import QuantizedLinear
from .kernels import dequantize
from .layers import apply_rope, attend, deinterleave, linear, rms_norm
from .spec import ModelSpec


def gqa_qkv(spec: ModelSpec, w: dict, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _projections(spec, w, x)          # [T, H*Dh], [T, K*Dh], [T, K*Dh]
    attention = spec.attention
    if attention.qk_norm == "proj":
        q, k = rms_norm(q, w["q_norm"], spec.rms_norm_eps), rms_norm(k, w["k_norm"], spec.rms_norm_eps)
    if attention.clip_qkv is not None:
        q, k, v = (t.clamp(-attention.clip_qkv, attention.clip_qkv) for t in (q, k, v))
    T = x.shape[0]
    q = q.view(T, spec.num_heads, spec.head_dim)
    k = k.view(T, spec.num_kv_heads, spec.head_dim)
    v = v.view(T, spec.num_kv_heads, spec.head_dim)
    if attention.qk_norm == "head":
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


def gqa_attend(spec: ModelSpec, w: dict, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
    """q [S, H, Dh] over the cached keys / values [K, L, Dh] -> [S, H * Dh] (GPT-OSS's sinks included)."""
    return attend(q, keys, values, mask, spec.attention.attention_scale, w.get("sinks"))


def mla_qkv(spec: ModelSpec, w: dict, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries q [T, H, N + R], and what the cache keeps of each token: its normed latent and
    rotated rope key, k [T, 1, Ckv + R] (values: [T, 1, 0], none)."""
    mla = spec.attention
    T, H, N, R = x.shape[0], spec.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
    if mla.q_lora_rank:
        q_latent = rms_norm(linear(x, w["q_a"], w.get("q_a_bias")), w["q_a_norm"], spec.rms_norm_eps)
        q = linear(q_latent, w["q_b"])
    else:
        q = linear(x, w["q"])
    q_nope, q_rope = q.view(T, H, N + R).split([N, R], dim=-1)
    latent, k_rope = linear(x, w["kv_a"], w.get("kv_a_bias")).split([mla.kv_lora_rank, R], dim=-1)
    latent = rms_norm(latent, w["kv_a_norm"], spec.rms_norm_eps)
    k_rope = k_rope.view(T, 1, R)
    if spec.rotary.rope_interleave:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
    k = torch.cat((latent.view(T, 1, -1), apply_rope(k_rope, cos, sin)), dim=-1)
    return q, k, k.new_empty(T, 1, 0)


def mla_attend(spec: ModelSpec, w: dict, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
    """q [S, H, N + R] over the cached latent rows keys [1, L, Ckv + R] (values empty) -> [S, H * Dv]:
    attention of the keys and values kv_b expands from them, absorbed or expanded, whichever costs
    less (docs/architecture.md, "Multi-head latent attention")."""
    mla = spec.attention
    S, H, N, Dv, Ckv = q.shape[0], spec.num_heads, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    scale = mla.softmax_scale(spec)
    if absorbs(spec, S):
        kv_b = float_weight(w["kv_b"]).view(H, N + Dv, Ckv)
        q_latent = torch.einsum("shn,hnc->shc", q[..., :N], kv_b[:, :N])
        context = attend(torch.cat((q_latent, q[..., N:]), dim=-1), keys, keys[..., :Ckv], mask, scale)
        return torch.einsum("shc,hvc->shv", context.view(S, H, Ckv), kv_b[:, N:]).reshape(S, H * Dv)
    L = keys.shape[1]
    latent, k_rope = keys[0].split([Ckv, keys.shape[-1] - Ckv], dim=-1)
    k_nope, v = linear(latent, w["kv_b"]).view(L, H, N + Dv).split([N, Dv], dim=-1)
    k = torch.cat((k_nope, k_rope.view(L, 1, -1).expand(L, H, -1)), dim=-1)
    return attend(q, k.transpose(0, 1), v.transpose(0, 1), mask, scale)


def absorbs(spec: ModelSpec, tokens: int) -> bool:
    """Whether mla_attend absorbs kv_b for a segment of `tokens` queries: where its extra attention
    work per cached position, tokens x H x (2 Ckv - N - Dv), is less than the expansion's,
    H x (N + Dv) x Ckv (a decode step: always; a 512-token prefill chunk: never)."""
    mla = spec.attention
    nope_and_value = mla.qk_nope_head_dim + mla.v_head_dim
    return tokens * (2 * mla.kv_lora_rank - nope_and_value) < nope_and_value * mla.kv_lora_rank


def float_weight(weight) -> torch.Tensor:
    """A projection's weight [R, C] as float32: dequantized where it is a QuantizedLinear."""
    if isinstance(weight, QuantizedLinear):
        return dequantize(weight.qt)
    return weight.float()


# Per attention kind (ModelSpec.attention.kind): its projections, and its attention over the cache.
QKV_PROJECTIONS = {"gqa": gqa_qkv, "mla": mla_qkv}
ATTEND = {"gqa": gqa_attend, "mla": mla_attend}
