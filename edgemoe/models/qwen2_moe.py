"""Qwen2-MoE: q/k/v biases, a shared expert behind a sigmoid gate, optional dense-MLP layers.

Checkpoint names: model.layers.{l}.mlp.gate.weight (router), mlp.experts.{e}.{gate,up,down}_proj.weight,
mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, D]; dense-MLP layers
(mlp_only_layers, decoder_sparse_step) use mlp.{gate,up,down}_proj.weight.
"""

from __future__ import annotations

from .common import Attention, attention_fields, llama_style_names, qwen_style_mlp_names, qwen_style_routing
from ..spec import ModelSpec, TensorNames, config_bool, config_int, config_list

MODEL_TYPE = "qwen2_moe"


def moe_layer_flags(config: dict, num_layers: int) -> tuple[bool, ...]:
    """Qwen's rule: layer l is MoE unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    mlp_only = set(config_list(config, "mlp_only_layers", "integer", default=[]))
    step = config_int(config, "decoder_sparse_step", default=1)
    return tuple(l not in mlp_only and (l + 1) % step == 0 for l in range(num_layers))


def sliding_windows(config: dict, num_layers: int) -> tuple[int | None, ...]:
    if not config_bool(config, "use_sliding_window", default=False):
        return (None,) * num_layers
    window = config_int(config, "sliding_window")
    window_layers = config_int(config, "max_window_layers", default=28, minimum=0)
    layer_types = config_list(config, "layer_types", "string", default=None) or [
        "sliding_attention" if (l + 1) % 2 and l < window_layers else "full_attention"
        for l in range(num_layers)]
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def parse_config(config: dict) -> ModelSpec:
    # older configs have no "qkv_bias" key: their biases are always present
    fields = attention_fields(config, attention=Attention(qkv_bias=config_bool(config, "qkv_bias", default=True)))
    num_layers = fields["num_layers"]
    return ModelSpec(
        model_type=MODEL_TYPE,
        **qwen_style_routing(config),
        expert_hidden=config_int(config, "moe_intermediate_size"),
        moe_layers=moe_layer_flags(config, num_layers),
        sliding_windows=sliding_windows(config, num_layers),
        dense_hidden=config_int(config, "intermediate_size"),
        shared_expert_hidden=config_int(config, "shared_expert_intermediate_size", minimum=0),
        **fields,
    )


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = llama_style_names(spec.num_layers, spec.tie_word_embeddings, spec.attention)
    experts = qwen_style_mlp_names(spec, names)
    for l in experts:
        src, dst = f"model.layers.{l}.mlp.", f"layers.{l}."
        for role in ("gate", "up", "down"):
            names[dst + f"shared.{role}"] = src + f"shared_expert.{role}_proj.weight"
        names[dst + "shared_gate"] = src + "shared_expert_gate.weight"
    return TensorNames(names, experts)
