"""GPT-OSS (openai/gpt-oss-20b, -120b): biased q/k/v/o, learned attention sinks, sliding-window attention
on alternate layers (layer_types), YaRN rotary embeddings (models/yarn.py), a biased router whose top-k
logits are softmaxed among themselves (TopKSoftmax), and experts computing a clamped SwiGLU with
biases (GptOssExperts; the function is edgemoe/kernels/activations.py's gpt_oss_expert); every layer MoE.

Checkpoint names (per layer l, prefix model.layers.{l}.): self_attn.{q,k,v,o}_proj.weight / .bias,
self_attn.sinks [H], mlp.router.weight [E, D] / .bias [E], and the experts fused (ExpertNames, fused
"gpt_oss"): mlp.experts.gate_up_proj [E, D, 2I] (gate and up interleaved, transposed) or, MXFP4
(config quantization_config {"quant_method": "mxfp4"}), mlp.experts.gate_up_proj_blocks / _scales;
likewise down_proj [E, I, D]; mlp.experts.gate_up_proj_bias [E, 2I] and down_proj_bias [E, D], which
the store keeps as dense tensors (expert_gate_up_bias, expert_down_bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import Attention, ExpertKind, Router, attention_fields, llama_style_names, register
from .yarn import yarn_fields
from ..errors import CheckpointError
from ..spec import (ExpertNames, ModelSpec, TensorNames, config_bool, config_float, config_int, config_list,
                    config_object, config_str, rope_parameters)

MODEL_TYPE = "gpt_oss"


@register
@dataclass(frozen=True)
class TopKSoftmax(Router):
    """GPT-OSS: the top_k of the logits plus router_bias [E], softmaxed among themselves."""

    kind = "topk_softmax"
    has_bias = True

    def choose(self, logits, bias, spec):
        top, experts = torch.topk(logits + bias, spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts


@register
@dataclass(frozen=True)
class GptOssExperts(ExpertKind):
    """GPT-OSS's clamped SwiGLU with biases; the biases are dense roles of each MoE layer, stacked over
    its experts."""

    kind = "gpt_oss"
    swiglu_alpha: float = 1.702     # glu = gate * sigmoid(swiglu_alpha * gate)
    swiglu_limit: float = 7.0       # gate clamped above, up on both sides, at this limit

    def dense_shapes(self, spec):
        return {"expert_gate_up_bias": (spec.num_experts, 2 * spec.expert_hidden),
                "expert_down_bias": (spec.num_experts, spec.hidden_size)}

    def arguments(self, dense, layer, expert):
        gate_up = dense[f"layers.{layer}.expert_gate_up_bias"][expert].float()    # [2I], interleaved
        return dict(gate_bias=gate_up[0::2], up_bias=gate_up[1::2],
                    down_bias=dense[f"layers.{layer}.expert_down_bias"][expert].float(),
                    alpha=self.swiglu_alpha, limit=self.swiglu_limit)


def sliding_windows(config: dict, num_layers: int) -> tuple[int | None, ...]:
    """The window of each layer: config.sliding_window on "sliding_attention" layers (by default
    the even ones, as transformers' GptOssConfig), None (full attention) on the others."""
    window = config_int(config, "sliding_window", default=None)
    layer_types = config_list(config, "layer_types", "string", default=None) or [
        "sliding_attention" if (l + 1) % 2 else "full_attention" for l in range(num_layers)]
    if len(layer_types) != num_layers:
        raise CheckpointError(f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise CheckpointError(f"layer_types: {unknown[0]!r} is not supported (sliding_attention, full_attention)")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def check_quantization(config: dict) -> None:
    """Only MXFP4 (decoded on read) or no quantization_config at all."""
    quantization = config_object(config, "quantization_config", default={})
    method = config_str(quantization, "quant_method", default="mxfp4", section="quantization_config")
    if method != "mxfp4":
        raise CheckpointError(f"quantization_config quant_method={method!r} is not supported (mxfp4 or none)")


def parse_config(config: dict) -> ModelSpec:
    check_quantization(config)
    bias = config_bool(config, "attention_bias", default=True)
    attention = Attention(qkv_bias=bias, o_bias=bias, attention_sinks=True)
    fields = attention_fields(config, rope_types=("default", "yarn"), attention=attention)
    fields["rms_norm_eps"] = config_float(config, "rms_norm_eps", default=1e-5, above=0)
    params = rope_parameters(config)
    if params["rope_type"] == "yarn":
        head_dim = fields["head_dim"]
        fields.update(yarn_fields(config, params, rope_dim=head_dim, attention=attention, key_dim=head_dim,
                                  base=fields["rotary"].rope_theta))
    num_layers = fields["num_layers"]
    return ModelSpec(
        model_type=MODEL_TYPE,
        num_experts=config_int(config, "num_local_experts", "num_experts"),
        top_k=config_int(config, "num_experts_per_tok"),
        norm_topk_prob=True,   # the top-k logits are softmaxed among themselves
        expert_hidden=config_int(config, "intermediate_size"),
        moe_layers=(True,) * num_layers,
        sliding_windows=sliding_windows(config, num_layers),
        routing=TopKSoftmax(),
        expert_kind=GptOssExperts(swiglu_alpha=config_float(config, "swiglu_alpha", default=1.702, above=0),
                                  swiglu_limit=config_float(config, "swiglu_limit", default=7.0, above=0)),
        **fields,
    )


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = llama_style_names(spec.num_layers, spec.tie_word_embeddings, spec.attention)
    experts = {}
    for l in range(spec.num_layers):
        src, dst = f"model.layers.{l}.", f"layers.{l}."
        names[dst + "router"] = src + "mlp.router.weight"
        names[dst + "router_bias"] = src + "mlp.router.bias"
        names[dst + "expert_gate_up_bias"] = src + "mlp.experts.gate_up_proj_bias"
        names[dst + "expert_down_bias"] = src + "mlp.experts.down_proj_bias"
        experts[l] = ExpertNames(src + "mlp.experts", "gate_proj", "up_proj", "down_proj", fused="gpt_oss")
    return TensorNames(names, experts)
