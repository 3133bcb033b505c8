"""Phi-3.5-MoE: Mixtral's layout with LayerNorm (weight and bias) instead of RMSNorm, biases on q/k/v/o
when attention_bias, an optional LM-head bias, and sparsemixer routing (two experts; at inference
deterministic: SparseMixer below).

Checkpoint names: Mixtral's (block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1 / w3 / w2
.weight) plus input_layernorm / post_attention_layernorm / model.norm .bias, self_attn.{q,k,v,o}_proj.bias
and lm_head.bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .common import Attention, Rotary, Router, SwiGLU, attention_fields, register
from .mixtral import tensor_names as mixtral_names
from ..errors import CheckpointError
from ..spec import ModelSpec, TensorNames, config_bool, config_float, config_int, config_list, rope_parameters

MODEL_TYPE = "phimoe"


@register
@dataclass(frozen=True)
class SparseMixer(Router):
    """Phi-3.5-MoE's sparsemixer at inference: the best expert, then the best of the rest; each weighs
    its softmax among the experts whose score is within a relative gap 2 * router_jitter_eps of it."""

    kind = "sparsemixer"
    router_jitter_eps: float = 0.0

    def check(self, spec):
        if spec.top_k != 2:
            raise CheckpointError(f"config: num_experts_per_tok={spec.top_k}: sparsemixer routing picks 2 experts")

    def choose(self, logits, bias, spec):
        first_weight, first = self._pick(logits, logits)
        rest = logits.scatter(-1, first, float("-inf"))
        second_weight, second = self._pick(rest, logits)
        return torch.cat((first_weight, second_weight), dim=-1), torch.cat((first, second), dim=-1)

    def _pick(self, candidates: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best of `candidates` [T, E] (-inf: not a candidate) and its weight, both [T, 1]."""
        best, index = candidates.max(dim=-1, keepdim=True)
        too_far = (best - scores) / scores.abs().clamp(min=best) > 2 * self.router_jitter_eps
        weights = torch.softmax(candidates.masked_fill(too_far, float("-inf")), dim=-1)
        return weights.gather(-1, index), index


@register
@dataclass(frozen=True, kw_only=True)
class LongRope(Rotary):
    """LongRoPE: theta's frequencies divided by per-frequency factors, cos and sin times a factor, from
    the short set until a step reaches past `rope_long_after` positions, from the long set then (as
    Phi-3.5-MoE's own code does)."""

    kind = "longrope"
    rope_inv_freq: tuple[float, ...]        # [R/2], the short set
    rope_attention_factor: float
    rope_long_after: int
    rope_long_inv_freq: tuple[float, ...]
    rope_long_attention_factor: float

    def __post_init__(self):
        for name in ("rope_inv_freq", "rope_long_inv_freq"):   # a manifest's lists
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def frequencies(self, positions):
        if positions.numel() and int(positions.max()) + 1 > self.rope_long_after:
            return self.rope_long_inv_freq, self.rope_long_attention_factor
        return self.rope_inv_freq, self.rope_attention_factor


def parse_config(config: dict) -> ModelSpec:
    bias = config_bool(config, "attention_bias", default=False)
    fields = attention_fields(config, rope_types=("default", "longrope"), attention=Attention(qkv_bias=bias, o_bias=bias))
    if rope_parameters(config)["rope_type"] == "longrope":
        fields["rotary"] = long_rope(config, fields["head_dim"], fields["rotary"].rope_theta)
    num_layers = fields["num_layers"]
    fields["rms_norm_eps"] = config_float(config, "rms_norm_eps", default=1e-5, above=0)  # the LayerNorms' eps
    return ModelSpec(
        model_type=MODEL_TYPE,
        num_experts=config_int(config, "num_local_experts"),
        top_k=config_int(config, "num_experts_per_tok"),
        norm_topk_prob=False,
        expert_hidden=config_int(config, "intermediate_size"),
        moe_layers=(True,) * num_layers,
        sliding_windows=(config_int(config, "sliding_window", default=None),) * num_layers,
        norm="layer",
        lm_head_bias=config_bool(config, "lm_head_bias", default=False),
        routing=SparseMixer(router_jitter_eps=config_float(config, "router_jitter_noise", default=0.01, minimum=0)),
        expert_kind=SwiGLU(),
        **fields,
    )


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = mixtral_names(spec)
    dense = names.dense
    dense["norm_bias"] = "model.norm.bias"
    for l in range(spec.num_layers):
        src, dst = f"model.layers.{l}.", f"layers.{l}."
        dense[dst + "attn_norm_bias"] = src + "input_layernorm.bias"
        dense[dst + "mlp_norm_bias"] = src + "post_attention_layernorm.bias"
    if spec.lm_head_bias:
        dense["lm_head_bias"] = "lm_head.bias"
    return names


def long_rope(config: dict, head_dim: int, base: float) -> LongRope:
    """LongRoPE as Phi-3.5-MoE configures it: rope_scaling type "longrope" with short_factor /
    long_factor per rotary frequency, short_mscale / long_mscale, and the long set past
    original_max_position_embeddings."""
    params = rope_parameters(config)
    where = f"{params['field']}"
    original = (config_int(config, "original_max_position_embeddings", default=None)
                or config_int(params, "original_max_position_embeddings", default=None, section=where))
    if original is None:
        raise CheckpointError(f"{where}: longrope needs original_max_position_embeddings")
    factor = config_int(config, "max_position_embeddings") / original
    default_mscale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    sets = {}
    for kind in ("short", "long"):
        factors = config_list(params, f"{kind}_factor", "number", default=None, section=where)
        if factors is None or len(factors) != head_dim // 2:
            raise CheckpointError(f"{where}: {kind}_factor must list {head_dim // 2} numbers (head_dim / 2)")
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** shape)
        mscale = config_float(params, f"{kind}_mscale", default=None, above=0, section=where)
        sets[kind] = (tuple(inv_freq.tolist()), mscale or default_mscale)
    return LongRope(rope_theta=base, rope_inv_freq=sets["short"][0], rope_attention_factor=sets["short"][1],
                    rope_long_after=original, rope_long_inv_freq=sets["long"][0],
                    rope_long_attention_factor=sets["long"][1])
