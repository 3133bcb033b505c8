"""OLMoE: RMSNorm over the whole query and key projections (q_norm [H*Dh], k_norm [K*Dh]), optional
clipping of q/k/v, top-k weights not renormalised by default; every layer MoE.
"""

from __future__ import annotations

from .common import Attention, attention_fields, llama_style_names, qwen_style_mlp_names, qwen_style_routing
from ..spec import ModelSpec, TensorNames, config_bool, config_float, config_int

MODEL_TYPE = "olmoe"


def parse_config(config: dict) -> ModelSpec:
    attention = Attention(qkv_bias=config_bool(config, "attention_bias", default=False), qk_norm="proj",
                          clip_qkv=config_float(config, "clip_qkv", default=None, above=0))
    fields = attention_fields(config, attention=attention)
    num_layers = fields["num_layers"]
    return ModelSpec(
        model_type=MODEL_TYPE,
        **qwen_style_routing(config),
        expert_hidden=config_int(config, "intermediate_size"),
        moe_layers=(True,) * num_layers,
        sliding_windows=(None,) * num_layers,
        **fields,
    )


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = llama_style_names(spec.num_layers, spec.tie_word_embeddings, spec.attention)
    return TensorNames(names, qwen_style_mlp_names(spec, names))
