"""Pieces shared by the architecture files: the common attention/norm part of a config and its names,
and the parts of a model an architecture file may declare its own kind of: its router (Router,
ModelSpec.routing), what its experts compute (ExpertKind, ModelSpec.expert_kind), how positions
rotate queries and keys (Rotary, ModelSpec.rotary), how a layer makes them (Attention,
ModelSpec.attention) and its layer stacks (Stacks, ModelSpec.stacks). Here: their base classes, the
registry of kinds (edgemoe.models.part_from_fields rebuilds one from a store manifest), and the kinds
most architectures use: softmax top-k routing, SwiGLU experts, theta's rotary frequencies,
grouped-query attention, one decoder stack.

Shapes: T tokens, E experts, A experts chosen per token, D hidden, I expert hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from ..errors import CheckpointError
from ..spec import config_bool, config_float, config_int, config_str, rope_theta


@dataclass(frozen=True)
class Part:
    """A part of the model that comes in kinds, each a frozen dataclass subclass declared in the
    architecture file that uses it (or here, when several share it) and made known with @register.
    Its parameters are its fields: a store manifest's spec holds them under their own names beside
    `key`: kind (the keys the manifests written before these classes already had). A subclass's own
    parameters have no defaults (kw_only, after its base's defaulted ones), so that a manifest
    lacking one is refused naming it (StoreError), not read with an invented value."""

    key: ClassVar[str]    # the manifest's key naming the kind, and the default kind when it is absent
    default: ClassVar[str]
    kind: ClassVar[str]

    def spec_fields(self) -> dict:
        return {self.key: self.kind, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def kind_before_key(cls, spec: dict) -> str:
        """The kind of a manifest's spec written before `key` existed."""
        return cls.default


KINDS: dict[str, dict[str, type[Part]]] = {}   # Part.key -> kind -> class; filled by @register


def register(cls: type[Part]) -> type[Part]:
    """Class decorator: makes the kind known to ModelSpec.from_dict (manifests name it by kind)."""
    KINDS.setdefault(cls.key, {})[cls.kind] = cls
    return cls


@dataclass(frozen=True)
class Router(Part):
    """How a MoE layer chooses its experts from its router's float32 logits: ModelSpec.routing.
    top_k, norm_topk_prob and routed_scaling_factor stay on ModelSpec: every kind reads them the same
    way (the decode engine too)."""

    key = "router"
    default = "softmax"
    has_bias: ClassVar[bool] = False   # a MoE layer has router_bias [E] (canonical roles: edgemoe/spec.py)

    def check(self, spec) -> None:
        """Refuse a spec this router cannot serve, with a CheckpointError naming the config field."""

    def choose(self, logits: torch.Tensor, bias: torch.Tensor | None, spec) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] float32 (bias [E] if has_bias) -> (weights [T, A] float32, experts [T, A] int64),
        before routed_scaling_factor."""
        raise NotImplementedError


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@register
@dataclass(frozen=True)
class SoftmaxTopK(Router):
    """Mixtral, Qwen, OLMoE, DeepSeek-V2 "greedy", Switch: the top_k softmax probabilities, renormalised
    if norm_topk_prob. The decode engine computes this kind in one numba call (edgemoe/decode.py)."""

    kind = "softmax"

    def choose(self, logits, bias, spec):
        return softmax_topk(logits, spec.top_k, spec.norm_topk_prob)


@dataclass(frozen=True)
class ExpertKind(Part):
    """What each routed expert computes: ModelSpec.expert_kind (the manifest's "expert_activation").
    A kind other than SwiGLU is computed by its function in edgemoe/kernels/activations.py (named in
    edgemoe.experts.ACTIVATIONS), over the compute path's matmul, with the arguments it gets here."""

    key = "expert_activation"
    default = "swiglu"
    roles: ClassVar[tuple[str, ...]] = ("gate", "up", "down")   # its matrices, in their stored order
    hidden_act: ClassVar[str] = "silu"                           # the dense MLP's activation with it

    def dense_shapes(self, spec) -> dict[str, tuple[int, ...]]:
        """Dense roles of a MoE layer beside its router (e.g. the experts' biases), with their shapes."""
        return {}

    def arguments(self, dense: dict[str, torch.Tensor], layer: int, expert: int) -> dict[str, Any]:
        """The keyword arguments of one expert's activation function: its biases, taken from the model's
        dense weights (canonical names), and the kind's parameters."""
        return {}


@register
@dataclass(frozen=True)
class SwiGLU(ExpertKind):
    """down(silu(gate x) * (up x)): every architecture but GPT-OSS and Switch."""

    kind = "swiglu"


@register
@dataclass(frozen=True)
class Rotary(Part):
    """How a step's positions turn queries and keys: ModelSpec.rotary. This kind, theta's frequencies,
    is every architecture's unless its file declares a scaled kind (YaRN, LongRoPE) as a subclass.
    Its rotated dims are ModelSpec.rope_dim (R) per head."""

    key = "rope_type"
    default = "default"
    kind = "default"
    rope_theta: float = 10000.0
    rope_interleave: bool = False   # the rotated pairs are adjacent dims (2i, 2i+1), not (i, i + R/2)

    @classmethod
    def kind_before_key(cls, spec: dict) -> str:
        """Manifests written before "rope_type" hold every kind's fields, None where unused."""
        if spec.get("rope_long_after") is not None:
            return "longrope"
        return "yarn" if spec.get("rope_inv_freq") is not None else cls.default

    def frequencies(self, positions: torch.Tensor) -> tuple[tuple[float, ...] | None, float]:
        """(inverse frequencies [R/2], None for theta's own; the factor on cos and sin) of a step at
        `positions` [T]."""
        return None, 1.0


QK_NORMS = (None, "head", "proj")   # Attention.qk_norm's values


@register
@dataclass(frozen=True)
class Attention(Part):
    """How a layer makes its queries, keys and values: ModelSpec.attention, computed by
    edgemoe/attention.py's QKV_PROJECTIONS[kind]. This kind, grouped-query attention (q, k, v, o of
    head_dim per head, num_kv_heads key/value heads), is every architecture's unless its file declares
    another as a subclass (DeepSeek's multi-head latent attention).
    Its parameters are the attention quirks of the families that use it; the defaults are Llama's
    (Mixtral's), so an architecture file sets only its own."""

    key = "attention"
    default = "gqa"
    kind = "gqa"
    qkv_bias: bool = False                 # biases on the q, k, v projections (latent: on q_a, kv_a)
    qk_norm: str | None = None             # RMSNorm of queries and keys: None, "head" (each head's,
                                           # Qwen3) or "proj" (the whole projection's, OLMoE)
    clip_qkv: float | None = None          # q, k, v clamped to [-clip_qkv, clip_qkv] (OLMoE)
    o_bias: bool = False                   # bias on the output projection
    attention_scale: float | None = None   # softmax scale of q.k; None: 1/sqrt(key dims)
    attention_sinks: bool = False          # a learned per-head logit joins each softmax (GPT-OSS)

    def __post_init__(self):
        if self.qk_norm not in QK_NORMS:
            raise CheckpointError(f"qk_norm={self.qk_norm!r} (expected one of {QK_NORMS})")

    def key_dim(self, spec) -> int:
        return spec.head_dim

    def rope_dim(self, spec) -> int:
        return spec.head_dim

    def softmax_scale(self, spec) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.key_dim(spec) ** -0.5 if self.attention_scale is None else self.attention_scale

    def cache_layout(self, spec) -> tuple[int, int, int]:
        """What the KV cache holds per layer and position: (heads, key dims, value dims)."""
        return spec.num_kv_heads, spec.head_dim, spec.head_dim

    def shapes(self, spec) -> dict[str, tuple[int, ...]]:
        """A layer's attention roles (canonical names without "layers.{l}.", edgemoe/spec.py) and shapes."""
        shapes = self.projection_shapes(spec)
        if self.o_bias:
            shapes["o_bias"] = (spec.hidden_size,)
        if self.attention_sinks:
            shapes["sinks"] = (spec.num_heads,)
        return shapes

    def projection_shapes(self, spec) -> dict[str, tuple[int, ...]]:
        """The kind's own roles: its projections, their biases and norms."""
        D, Dh = spec.hidden_size, spec.head_dim
        q_out, kv_out = spec.num_heads * Dh, spec.num_kv_heads * Dh
        shapes = {"q": (q_out, D), "k": (kv_out, D), "v": (kv_out, D), "o": (D, q_out)}
        if self.qkv_bias:
            shapes.update({"q_bias": (q_out,), "k_bias": (kv_out,), "v_bias": (kv_out,)})
        if self.qk_norm == "head":
            shapes.update({"q_norm": (Dh,), "k_norm": (Dh,)})
        elif self.qk_norm == "proj":
            shapes.update({"q_norm": (q_out,), "k_norm": (kv_out,)})
        return shapes


@register
@dataclass(frozen=True)
class Stacks(Part):
    """The model's layer stacks: ModelSpec.stacks. This kind, one decoder stack (edgemoe.model.MoEModel
    runs it), is every architecture's but Switch Transformers', whose file declares an encoder then a
    decoder (edgemoe.seq2seq.Seq2SeqModel runs it)."""

    key = "stacks"
    default = "decoder"
    kind = "decoder"
    encoder_layers: ClassVar[int] = 0   # the first layers of num_layers that are the encoder's

    @classmethod
    def kind_before_key(cls, spec: dict) -> str:
        """Manifests written before "stacks" hold the encoder-decoder's fields, encoder_layers 0 where unused."""
        return "encoder_decoder" if spec.get("encoder_layers") else cls.default

    def check(self, spec) -> None:
        """Refuse a spec these stacks cannot hold, with a CheckpointError naming the config field."""


def qwen_style_routing(config: dict) -> dict:
    """ModelSpec fields of the routing Qwen2/3-MoE and OLMoE share: softmax top-k over num_experts (or
    num_local_experts), renormalised only where norm_topk_prob says so, SwiGLU experts."""
    return dict(num_experts=config_int(config, "num_experts", "num_local_experts"),
                top_k=config_int(config, "num_experts_per_tok"),
                norm_topk_prob=config_bool(config, "norm_topk_prob", default=False),
                routing=SoftmaxTopK(), expert_kind=SwiGLU())


def attention_fields(config: dict, rope_types: tuple[str, ...] = ("default",),
                     attention: Attention = Attention()) -> dict:
    """ModelSpec fields that every supported architecture reads the same way from config.json
    (rotary types other than `rope_types` are refused), with the architecture's `attention` part."""
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
        rotary=Rotary(rope_theta=rope_theta(config, rope_types)),
        attention=attention,
        stacks=Stacks(),
        max_position_embeddings=config_int(config, "max_position_embeddings", default=4096),
        tie_word_embeddings=config_bool(config, "tie_word_embeddings", default=False),
        hidden_act=config_str(config, "hidden_act", default="silu"),
    )


def llama_style_names(num_layers: int, tie_word_embeddings: bool, attention: Attention | None = None) -> dict[str, str]:
    """Canonical -> checkpoint names for the Llama-style parts (embeddings, attention with the biases,
    q/k norms and sinks its `attention` part has, norms)."""
    attention = attention or Attention()
    names = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if not tie_word_embeddings:
        names["lm_head"] = "lm_head.weight"
    for l in range(num_layers):
        src, dst = f"model.layers.{l}.", f"layers.{l}."
        names[dst + "attn_norm"] = src + "input_layernorm.weight"
        names[dst + "mlp_norm"] = src + "post_attention_layernorm.weight"
        for role in "qkvo":
            names[dst + role] = src + f"self_attn.{role}_proj.weight"
        if attention.qkv_bias:
            for role in "qkv":
                names[dst + f"{role}_bias"] = src + f"self_attn.{role}_proj.bias"
        if attention.qk_norm:
            names[dst + "q_norm"] = src + "self_attn.q_norm.weight"
            names[dst + "k_norm"] = src + "self_attn.k_norm.weight"
        if attention.o_bias:
            names[dst + "o_bias"] = src + "self_attn.o_proj.bias"
        if attention.attention_sinks:
            names[dst + "sinks"] = src + "self_attn.sinks"
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
