"""Phi-3.5-MoE: Mixtral's layout with LayerNorm (weight and bias) instead of RMSNorm, biases on q/k/v/o
when attention_bias, an optional LM-head bias, and sparsemixer routing (two experts; at inference
deterministic: see route_sparsemixer in edgemoe/layers.py).

Checkpoint names: Mixtral's (block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1 / w3 / w2
.weight) plus input_layernorm / post_attention_layernorm / model.norm .bias, self_attn.{q,k,v,o}_proj.bias
and lm_head.bias.
"""

from __future__ import annotations

from .common import attention_fields
from .mixtral import tensor_names as mixtral_names
from ..spec import ModelSpec, TensorNames, config_value

MODEL_TYPE = "phimoe"


def parse_config(config: dict) -> ModelSpec:
    fields = attention_fields(config)
    num_layers = fields["num_layers"]
    bias = bool(config.get("attention_bias", False))
    fields["rms_norm_eps"] = float(config_value(config, "rms_norm_eps", default=1e-5))  # the LayerNorms' eps
    return ModelSpec(
        model_type=MODEL_TYPE,
        num_experts=config_value(config, "num_local_experts"),
        top_k=config_value(config, "num_experts_per_tok"),
        norm_topk_prob=False,
        expert_hidden=config_value(config, "intermediate_size"),
        moe_layers=(True,) * num_layers,
        sliding_windows=(config.get("sliding_window"),) * num_layers,
        norm="layer",
        qkv_bias=bias,
        o_bias=bias,
        lm_head_bias=bool(config.get("lm_head_bias", False)),
        router="sparsemixer",
        router_jitter_eps=float(config_value(config, "router_jitter_noise", default=0.01)),
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
        if spec.qkv_bias:
            dense.update({dst + f"{role}_bias": src + f"self_attn.{role}_proj.bias" for role in "qkv"})
        if spec.o_bias:
            dense[dst + "o_bias"] = src + "self_attn.o_proj.bias"
    if spec.lm_head_bias:
        dense["lm_head_bias"] = "lm_head.bias"
    return names
