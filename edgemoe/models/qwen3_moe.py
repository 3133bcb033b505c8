"""Qwen3-MoE: RMSNorm on each query/key head (q_norm, k_norm over Dh), no shared expert.

Checkpoint names as Qwen2-MoE without the shared expert, plus self_attn.q_norm / k_norm .weight [Dh].
"""

from __future__ import annotations

from .common import Attention, attention_fields, llama_style_names, qwen_style_mlp_names, qwen_style_routing
from .qwen2_moe import moe_layer_flags
from ..spec import ModelSpec, TensorNames, config_bool, config_int

MODEL_TYPE = "qwen3_moe"


def parse_config(config: dict) -> ModelSpec:
    attention = Attention(qkv_bias=config_bool(config, "attention_bias", default=False), qk_norm="head")
    fields = attention_fields(config, attention=attention)
    num_layers = fields["num_layers"]
    sliding = config_bool(config, "use_sliding_window", default=False)
    window = config_int(config, "sliding_window", default=None) if sliding else None
    return ModelSpec(
        model_type=MODEL_TYPE,
        **qwen_style_routing(config),
        expert_hidden=config_int(config, "moe_intermediate_size"),
        moe_layers=moe_layer_flags(config, num_layers),
        sliding_windows=(window,) * num_layers,
        dense_hidden=config_int(config, "intermediate_size"),
        **fields,
    )


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = llama_style_names(spec.num_layers, spec.tie_word_embeddings, spec.attention)
    return TensorNames(names, qwen_style_mlp_names(spec, names))
