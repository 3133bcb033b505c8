"""DeepSeek-V2 / V2-Lite: multi-head latent attention, always-on shared experts, dense first layers,
softmax routing (greedy or group-limited) scaled by routed_scaling_factor; default or YaRN rotary
embeddings (models/yarn.py).

Checkpoint names (per layer l, prefix model.layers.{l}.):
    self_attn.q_proj.weight (q_lora_rank null, V2-Lite) or self_attn.q_a_proj / q_a_layernorm / q_b_proj,
    self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj .weight (+ .bias with attention_bias);
    MoE layers: mlp.gate.weight (router), mlp.experts.{e}.{gate,up,down}_proj.weight,
    mlp.shared_experts.{gate,up,down}_proj.weight; dense layers: mlp.{gate,up,down}_proj.weight.
A layer is MoE when l >= first_k_dense_replace and l % moe_layer_freq == 0 (DeepSeek's rule).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import CheckpointError
from .common import (Attention, Router, SoftmaxTopK, SwiGLU, attention_fields, llama_style_names,
                     qwen_style_mlp_names, register)
from ..spec import ModelSpec, TensorNames, config_bool, config_float, config_int, config_str, rope_parameters
from .yarn import yarn_fields

MODEL_TYPE = "deepseek_v2"
TOPK_METHODS = ("greedy", "group_limited_greedy")


@register
@dataclass(frozen=True, kw_only=True)
class LatentAttention(Attention):
    """Multi-head latent attention (edgemoe/attention.py mla_qkv, mla_attend; canonical roles in
    edgemoe/spec.py): keys and values expanded per head from a latent of kv_lora_rank dims, queries from one of
    q_lora_rank dims (0: a plain q projection); per head, qk_nope_head_dim query/key dims without
    rotary embedding and qk_rope_head_dim with, v_head_dim value dims."""

    kind = "mla"
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def key_dim(self, spec):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def rope_dim(self, spec):
        return self.qk_rope_head_dim

    def cache_layout(self, spec):
        """The normed latent and the rotated rope key, shared by every head (edgemoe/attention.py mla_attend)."""
        return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0

    def projection_shapes(self, spec):
        D, H, Cq, Ckv = spec.hidden_size, spec.num_heads, self.q_lora_rank, self.kv_lora_rank
        R, Dv = self.qk_rope_head_dim, self.v_head_dim
        q_out = H * self.key_dim(spec)
        shapes = {"kv_a": (Ckv + R, D), "kv_a_norm": (Ckv,), "kv_b": (H * (self.qk_nope_head_dim + Dv), Ckv),
                  "o": (D, H * Dv)}
        if Cq:
            shapes.update({"q_a": (Cq, D), "q_a_norm": (Cq,), "q_b": (q_out, Cq)})
        else:
            shapes["q"] = (q_out, D)
        if self.qkv_bias:
            shapes["kv_a_bias"] = (Ckv + R,)
            if Cq:
                shapes["q_a_bias"] = (Cq,)
        return shapes


@dataclass(frozen=True)
class GroupLimitedRouter(Router):
    """Group-limited routing: the E experts form n_group groups of E/G; a token's experts come only
    from the topk_group groups that group_score ranks highest (G expert groups)."""

    n_group: int = 1
    topk_group: int = 1

    def check(self, spec) -> None:
        E = spec.num_experts
        if self.n_group < 1 or E % self.n_group:
            raise CheckpointError(f"config: n_group={self.n_group} does not divide {E} experts")
        if not 1 <= self.topk_group <= self.n_group:
            raise CheckpointError(f"config: topk_group={self.topk_group} outside 1..n_group={self.n_group}")
        self.check_group_size(E // self.n_group)
        kept = self.topk_group * E // self.n_group
        if spec.top_k > kept:
            raise CheckpointError(f"config: num_experts_per_tok={spec.top_k} exceeds the {kept} experts "
                                  f"of topk_group={self.topk_group} groups")

    def check_group_size(self, size: int) -> None:
        """Refuse groups of `size` experts that group_score cannot rank."""

    @staticmethod
    def group_score(grouped: torch.Tensor) -> torch.Tensor:
        """[T, G, E/G] -> [T, G]: a group's rank."""
        raise NotImplementedError

    def top_experts(self, choice: torch.Tensor, top_k: int) -> torch.Tensor:
        """Experts [T, A] with the top_k highest `choice` scores [T, E] among the kept groups."""
        T = choice.shape[0]
        grouped = choice.view(T, self.n_group, -1)                                    # [T, G, E/G]
        kept = torch.topk(self.group_score(grouped), self.topk_group, dim=-1).indices  # [T, topk_group]
        in_kept = torch.zeros(T, self.n_group, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~in_kept[..., None], float("-inf")).view(T, -1)
        return torch.topk(choice, top_k, dim=-1).indices


@register
@dataclass(frozen=True)
class GroupLimitedSoftmax(GroupLimitedRouter):
    """DeepSeek-V2 "group_limited_greedy": softmax, experts only from the groups with the highest best score."""

    kind = "softmax_group"

    @staticmethod
    def group_score(grouped):
        return grouped.max(dim=-1).values

    def choose(self, logits, bias, spec):
        probs = torch.softmax(logits, dim=-1)
        experts = self.top_experts(probs, spec.top_k)
        return probs.gather(1, experts), experts


def moe_layer_flags(config: dict, num_layers: int) -> tuple[bool, ...]:
    first_dense = config_int(config, "first_k_dense_replace", default=0, minimum=0)
    freq = config_int(config, "moe_layer_freq", default=1)
    return tuple(l >= first_dense and l % freq == 0 for l in range(num_layers))


def mla_fields(config: dict, rope_interleave: bool) -> dict:
    """The ModelSpec fields of multi-head latent attention (and of the DeepSeek family's common parts),
    the rotated pairs adjacent dims or not."""
    fields = attention_fields(config, rope_types=("default", "yarn"))
    if config_bool(config, "mlp_bias", default=False):
        raise CheckpointError("mlp_bias=true is not supported")
    nope = config_int(config, "qk_nope_head_dim")
    rope = config_int(config, "qk_rope_head_dim")
    num_layers = fields["num_layers"]
    # Every head has its own key and value (expanded from the latent): K = H, whatever
    # num_key_value_heads says; head_dim is the key's (nope + rope) dims.
    bias = config_bool(config, "attention_bias", default=False)
    attention = LatentAttention(q_lora_rank=config_int(config, "q_lora_rank", default=0, minimum=0),
                                kv_lora_rank=config_int(config, "kv_lora_rank"), qk_nope_head_dim=nope,
                                qk_rope_head_dim=rope, v_head_dim=config_int(config, "v_head_dim"),
                                qkv_bias=bias, o_bias=bias)
    fields.update(num_kv_heads=fields["num_heads"], head_dim=nope + rope, attention=attention)
    params = rope_parameters(config)
    if params["rope_type"] == "yarn":
        fields.update(yarn_fields(config, params, rope_dim=rope, attention=attention, key_dim=nope + rope,
                                  base=fields["rotary"].rope_theta))
    fields["rotary"] = replace(fields["rotary"], rope_interleave=rope_interleave)
    shared = config_int(config, "n_shared_experts", default=0, minimum=0)
    expert_hidden = config_int(config, "moe_intermediate_size")
    return dict(
        expert_kind=SwiGLU(),
        num_experts=config_int(config, "n_routed_experts", "num_experts", "num_local_experts"),
        top_k=config_int(config, "num_experts_per_tok"),
        expert_hidden=expert_hidden,
        moe_layers=moe_layer_flags(config, num_layers),
        sliding_windows=(None,) * num_layers,
        dense_hidden=config_int(config, "intermediate_size"),
        shared_expert_hidden=shared * expert_hidden,
        shared_expert_gated=False,
        routed_scaling_factor=config_float(config, "routed_scaling_factor", default=1.0, above=0),
        **fields,
    )


def parse_config(config: dict) -> ModelSpec:
    method = config_str(config, "topk_method", default="greedy")
    if method not in TOPK_METHODS:
        raise CheckpointError(f"topk_method={method!r} is not supported "
                              f"(supported: {', '.join(TOPK_METHODS)})")
    if config_bool(config, "norm_topk_prob", default=False):
        # transformers' DeepSeek-V2 ignores it, DeepSeek's own code renormalises without the scaling
        # factor: refuse rather than pick one.
        raise CheckpointError("norm_topk_prob=true is not supported for deepseek_v2")
    routing = SoftmaxTopK()
    if method == "group_limited_greedy":
        routing = GroupLimitedSoftmax(config_int(config, "n_group"), config_int(config, "topk_group"))
    return ModelSpec(
        model_type=MODEL_TYPE,
        norm_topk_prob=False,
        routing=routing,
        **mla_fields(config, rope_interleave=True),   # V2 rotates adjacent pairs (complex multiplication)
    )


def mla_names(spec: ModelSpec, names: dict[str, str]) -> None:
    """Replace the Llama-style q/k/v/o names by MLA's."""
    for l in range(spec.num_layers):
        src, dst = f"model.layers.{l}.self_attn.", f"layers.{l}."
        for role in "qkvo":
            names.pop(dst + role)
        roles = {"kv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
                 "kv_b": "kv_b_proj.weight", "o": "o_proj.weight"}
        if spec.attention.q_lora_rank:
            roles.update(q_a="q_a_proj.weight", q_a_norm="q_a_layernorm.weight", q_b="q_b_proj.weight")
        else:
            roles["q"] = "q_proj.weight"
        if spec.attention.qkv_bias:
            roles["kv_a_bias"] = "kv_a_proj_with_mqa.bias"
            if spec.attention.q_lora_rank:
                roles["q_a_bias"] = "q_a_proj.bias"
        if spec.attention.o_bias:
            roles["o_bias"] = "o_proj.bias"
        names.update({dst + role: src + name for role, name in roles.items()})


def deepseek_names(spec: ModelSpec) -> TensorNames:
    names = llama_style_names(spec.num_layers, spec.tie_word_embeddings)
    mla_names(spec, names)
    experts = qwen_style_mlp_names(spec, names)
    for l in experts:
        src, dst = f"model.layers.{l}.mlp.", f"layers.{l}."
        for role in ("gate", "up", "down"):
            names[dst + f"shared.{role}"] = src + f"shared_experts.{role}_proj.weight"
    return TensorNames(names, experts)


def tensor_names(spec: ModelSpec) -> TensorNames:
    return deepseek_names(spec)
