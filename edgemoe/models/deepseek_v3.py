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

from dataclasses import dataclass, replace

import torch

from .common import register
from .deepseek_v2 import GroupLimitedRouter, deepseek_names, mla_fields
from ..errors import CheckpointError
from ..spec import ModelSpec, TensorNames, config_bool, config_int

MODEL_TYPE = "deepseek_v3"


@register
@dataclass(frozen=True)
class SigmoidGroup(GroupLimitedRouter):
    """DeepSeek-V3: sigmoid scores; the bias [E] (e_score_correction_bias) only steers selection, groups
    ranked by the sum of their two best biased scores; weights are the unbiased scores, renormalised if
    norm_topk_prob."""

    kind = "sigmoid_group"
    has_bias = True

    def check_group_size(self, size):
        if size < 2:
            raise CheckpointError(f"config: n_group={self.n_group} leaves fewer than 2 experts per group "
                                  "(groups are ranked by their two best scores)")

    @staticmethod
    def group_score(grouped):
        return grouped.topk(2, dim=-1).values.sum(dim=-1)

    def choose(self, logits, bias, spec):
        scores = torch.sigmoid(logits)
        experts = self.top_experts(scores + bias, spec.top_k)
        weights = scores.gather(1, experts)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, experts


def parse_config(config: dict) -> ModelSpec:
    return ModelSpec(
        model_type=MODEL_TYPE,
        norm_topk_prob=config_bool(config, "norm_topk_prob", default=True),
        routing=SigmoidGroup(n_group=config_int(config, "n_group", default=1),
                             topk_group=config_int(config, "topk_group", default=1)),
        skipped_layers=config_int(config, "num_nextn_predict_layers", "num_mtp_layers", default=0, minimum=0),
        **mla_fields(config, rope_interleave=config_bool(config, "rope_interleave", default=True)),
    )


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = deepseek_names(spec)
    for l in names.experts:
        names.dense[f"layers.{l}.router_bias"] = f"model.layers.{l}.mlp.gate.e_score_correction_bias"
    mtp_layers = range(spec.num_layers, spec.num_layers + spec.skipped_layers)
    return replace(names, ignored_prefixes=tuple(f"model.layers.{l}." for l in mtp_layers))
