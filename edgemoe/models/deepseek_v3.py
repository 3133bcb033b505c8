"""DeepSeek-V3 (and checkpoints with its model_type): DeepSeek-V2's multi-head
latent attention, shared experts and dense first layers, with sigmoid routing: the selection-only bias
e_score_correction_bias [E], groups ranked by the sum of their two best scores, weights renormalised
(norm_topk_prob) and scaled by routed_scaling_factor. rope_interleave (default true) chooses between
rotating adjacent pairs and the half-split layout.

Checkpoint names: DeepSeek-V2's plus model.layers.{l}.mlp.gate.e_score_correction_bias. The multi-token
prediction layers that follow the num_hidden_layers decoder layers (num_nextn_predict_layers) are not
used for generation; their tensors are skipped.
"""

from __future__ import annotations

from dataclasses import replace

from .deepseek_v2 import deepseek_names, mla_fields
from ..spec import ModelSpec, TensorNames, config_bool, config_int

MODEL_TYPE = "deepseek_v3"


def parse_config(config: dict) -> ModelSpec:
    return ModelSpec(
        model_type=MODEL_TYPE,
        norm_topk_prob=config_bool(config, "norm_topk_prob", default=True),
        router="sigmoid_group",
        n_group=config_int(config, "n_group", default=1),
        topk_group=config_int(config, "topk_group", default=1),
        rope_interleave=config_bool(config, "rope_interleave", default=True),
        skipped_layers=config_int(config, "num_nextn_predict_layers", "num_mtp_layers", default=0, minimum=0),
        **mla_fields(config),
    )


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = deepseek_names(spec)
    for l in names.experts:
        names.dense[f"layers.{l}.router_bias"] = f"model.layers.{l}.mlp.gate.e_score_correction_bias"
    mtp_layers = range(spec.num_layers, spec.num_layers + spec.skipped_layers)
    return replace(names, ignored_prefixes=tuple(f"model.layers.{l}." for l in mtp_layers))
