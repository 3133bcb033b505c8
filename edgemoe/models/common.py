"""Pieces shared by the architecture files: the common attention/norm part of a config and its names."""

from __future__ import annotations

from ..spec import config_bool, config_float, config_int, config_str, rope_theta


def attention_fields(config: dict, rope_types: tuple[str, ...] = ("default",)) -> dict:
    """ModelSpec fields that every supported architecture reads the same way from config.json
    (rotary types other than `rope_types` are refused)."""
    hidden = config_int(config, "hidden_size")
    heads = config_int(config, "num_attention_heads")
    num_layers = config_int(config, "num_hidden_layers")
    return dict(
        vocab_size=config_int(config, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=config_int(config, "num_key_value_heads", default=heads),
        head_dim=config_int(config, "head_dim", default=hidden // heads),
        rms_norm_eps=config_float(config, "rms_norm_eps", default=1e-6, above=0),
        rope_theta=rope_theta(config, rope_types),
        max_position_embeddings=config_int(config, "max_position_embeddings", default=4096),
        tie_word_embeddings=config_bool(config, "tie_word_embeddings", default=False),
        hidden_act=config_str(config, "hidden_act", default="silu"),
    )


def llama_style_names(num_layers: int, tie_word_embeddings: bool, *, qkv_bias: bool = False,
                      qk_norm: bool = False) -> dict[str, str]:
    """Canonical -> checkpoint names for the Llama-style parts (embeddings, attention, norms)."""
    names = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if not tie_word_embeddings:
        names["lm_head"] = "lm_head.weight"
    for l in range(num_layers):
        src, dst = f"model.layers.{l}.", f"layers.{l}."
        names[dst + "attn_norm"] = src + "input_layernorm.weight"
        names[dst + "mlp_norm"] = src + "post_attention_layernorm.weight"
        for role in "qkvo":
            names[dst + role] = src + f"self_attn.{role}_proj.weight"
        if qkv_bias:
            for role in "qkv":
                names[dst + f"{role}_bias"] = src + f"self_attn.{role}_proj.bias"
        if qk_norm:
            names[dst + "q_norm"] = src + "self_attn.q_norm.weight"
            names[dst + "k_norm"] = src + "self_attn.k_norm.weight"
    return names


def qwen_style_mlp_names(spec, names: dict[str, str]) -> dict:
    """Router, dense-MLP and expert names of the Qwen / OLMoE family (`mlp.` prefix); fills `names`."""
    from ..spec import ExpertNames

    experts = {}
    for l in range(spec.num_layers):
        src, dst = f"model.layers.{l}.mlp.", f"layers.{l}."
        if spec.moe_layers[l]:
            names[dst + "router"] = src + "gate.weight"
            experts[l] = ExpertNames(src + "experts", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
        else:
            for role in ("gate", "up", "down"):
                names[dst + f"mlp.{role}"] = src + f"{role}_proj.weight"
    return experts
