"""Mixtral (and checkpoints with Mixtral's names): every layer MoE, softmax top-k renormalised.

Checkpoint names: model.layers.{l}.block_sparse_moe.gate.weight (router [E, D]) and
model.layers.{l}.block_sparse_moe.experts.{e}.w1 / w3 / w2 .weight (gate, up, down).
"""

from __future__ import annotations

from .common import SoftmaxTopK, SwiGLU, attention_fields, llama_style_names
from ..spec import ExpertNames, ModelSpec, TensorNames, config_int

MODEL_TYPE = "mixtral"


def parse_config(config: dict) -> ModelSpec:
    fields = attention_fields(config)
    num_layers = fields["num_layers"]
    window = config_int(config, "sliding_window", default=None)
    return ModelSpec(
        model_type=MODEL_TYPE,
        num_experts=config_int(config, "num_local_experts"),
        top_k=config_int(config, "num_experts_per_tok"),
        norm_topk_prob=True,  # Mixtral always renormalises the top-k weights
        routing=SoftmaxTopK(),
        expert_kind=SwiGLU(),
        expert_hidden=config_int(config, "intermediate_size"),
        moe_layers=(True,) * num_layers,
        sliding_windows=(window,) * num_layers,
        **fields,
    )


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = llama_style_names(spec.num_layers, spec.tie_word_embeddings, spec.attention)
    experts = {}
    for l in range(spec.num_layers):
        moe = f"model.layers.{l}.block_sparse_moe."
        names[f"layers.{l}.router"] = moe + "gate.weight"
        experts[l] = ExpertNames(moe + "experts", "w1.weight", "w3.weight", "w2.weight")
    return TensorNames(names, experts)
