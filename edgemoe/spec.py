"""What every architecture file produces: a ModelSpec and the map from canonical roles to checkpoint names.

The runtime, the store and the converter speak only canonical names; each architecture file is the one
place where its checkpoint's names are mapped to them.

Canonical dense roles (shapes; D hidden, V vocab, H heads, K kv heads, Dh head dim, F dense MLP hidden,
S shared-expert hidden, E experts):
    embed [V, D]   norm [D]   lm_head [V, D] (absent when tied to embed)  (+ lm_head_bias [V])
    layers.{l}.attn_norm [D]  .mlp_norm [D]   (norm="layer": + norm_bias, .attn_norm_bias, .mlp_norm_bias [D])
    layers.{l}.q [H*Dh, D]  .k [K*Dh, D]  .v [K*Dh, D]  .o [D, H*Dh]  (+ .q_bias .k_bias .v_bias, + .o_bias [D])
    layers.{l}.q_norm / .k_norm  [Dh] ("head" norms) or [H*Dh] / [K*Dh] ("proj" norms)
    layers.{l}.router [E, D]  (+ .router_bias [E] where the router kind has one (Router.has_bias): DeepSeek-V3's
        selection-only bias, GPT-OSS's logit bias)
    layers.{l}.sinks [H]      (attention_sinks: one learned extra logit per head in the softmax denominator)
    layers.{l}.shared.gate / .up [S, D]  .shared.down [D, S]  .shared_gate [1, D] (absent when ungated)
    layers.{l}.mlp.gate / .up [F, D]  .mlp.down [D, F]       (dense-MLP layers)
Multi-head latent attention (attention="mla"; N nope dims, R rope dims, Dv value dims per head,
Cq / Ckv query / key-value latent ranks) replaces q, k, v, o by:
    layers.{l}.q [H*(N+R), D] when Cq = 0, else .q_a [Cq, D]  .q_a_norm [Cq]  .q_b [H*(N+R), Cq]
    layers.{l}.kv_a [Ckv+R, D]  .kv_a_norm [Ckv]  .kv_b [H*(N+Dv), Ckv]  .o [D, H*Dv]
    (+ .q_a_bias [Cq], .kv_a_bias [Ckv+R] and .o_bias [D] with attention biases)
Experts (I expert hidden): (layer, expert) -> gate [I, D], up [I, D], down [D, I]; an ungated expert
(Switch's relu kind) has no gate. An expert kind may add dense roles of its own per MoE layer
(ExpertKind.dense_shapes), e.g. GPT-OSS's biases, dense and stacked over a layer's experts:
    layers.{l}.expert_gate_up_bias [E, 2I] (gate biases at even indices, up at odd, as GPT-OSS stores them)
    layers.{l}.expert_down_bias [E, D]

Encoder-decoder models (stacks.encoder_layers > 0, Switch Transformers; B relative-position buckets): layers
0..encoder_layers-1 are the encoder stack, the rest the decoder stack, so (layer, expert) keys of both stacks
share one space. Roles: embed [V, D] (the decoder's, and the encoder's when tied)  enc_norm [D] (encoder's
final norm)  norm [D] (decoder's)  lm_head [V, D] and enc_embed [V, D] (the encoder's): both absent when tied
    layers.{l}.attn_norm .q .k .v .o  .mlp_norm   (no biases, Dh = d_kv)
    layers.{l}.rel_bias [B, H]   (the first layer of each stack; shared by the stack's layers)
    layers.{l}.cross_norm [D]  .cross.q .cross.k .cross.v [H*Dh, D]  .cross.o [D, H*Dh]   (decoder layers)
    layers.{l}.mlp.up [F, D]  .mlp.down [D, F]   (dense layers: ungated, relu)   .router [E, D] (MoE layers)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import CheckpointError


POSITIVE_INTEGERS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings", "num_experts", "top_k", "expert_hidden")


# ModelSpec's fields that hold a Part (edgemoe/models/common.py), and the Part's class there.
PARTS = {"routing": "Router", "expert_kind": "ExpertKind", "rotary": "Rotary", "attention": "Attention",
         "stacks": "Stacks"}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture-independent description of a decoder-only MoE transformer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    expert_hidden: int
    moe_layers: tuple[bool, ...]          # per layer: MoE block (True) or dense MLP (False)
    sliding_windows: tuple[int | None, ...]  # per layer: attention window, None = full
    # How a MoE layer chooses its experts: a Router (edgemoe/models/common.py) of the kind the architecture
    # file declares, holding that kind's parameters (DeepSeek's expert groups, Phi-3.5-MoE's jitter, ...).
    routing: Any
    # What each routed expert computes: an ExpertKind (edgemoe/models/common.py) the architecture file
    # declares, holding that kind's parameters (GPT-OSS's clamp, ...); its roles and dense-MLP activation.
    expert_kind: Any
    # How a step's positions turn queries and keys: a Rotary (edgemoe/models/common.py) of the kind the
    # architecture file declares (theta's frequencies, YaRN, LongRoPE), holding that kind's parameters.
    rotary: Any
    # How a layer makes its queries, keys and values: an Attention (edgemoe/models/common.py) of the kind
    # the architecture file declares (grouped-query; DeepSeek's multi-head latent attention, its ranks),
    # with its family's quirks (q/k/v and output biases, q/k norms, clipping, softmax scale, sinks).
    attention: Any
    # The layer stacks: a Stacks (edgemoe/models/common.py), one decoder stack, or an encoder then a
    # decoder (Switch Transformers: its file's kind, with the first encoder_layers of num_layers).
    stacks: Any
    dense_hidden: int = 0
    shared_expert_hidden: int = 0         # 0: no shared expert
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # Optional parts of newer architectures; the defaults are the Llama-style model above.
    norm: str = "rms"                     # "rms" (RMSNorm) or "layer" (LayerNorm with bias, Phi-3.5-MoE)
    lm_head_bias: bool = False
    routed_scaling_factor: float = 1.0    # multiplies the routed experts' weights
    shared_expert_gated: bool = True      # shared expert behind a sigmoid gate (Qwen2-MoE) or always on
    skipped_layers: int = 0               # checkpoint layers after the decoder's that generation does not
                                          # use (DeepSeek-V3's multi-token prediction): their tensors are skipped

    def __post_init__(self):
        for name in POSITIVE_INTEGERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"config: num_attention_heads={self.num_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise CheckpointError(f"config: num_experts_per_tok={self.top_k} with {self.num_experts} experts")
        if self.hidden_act != self.expert_kind.hidden_act:
            raise CheckpointError(f"config: hidden_act={self.hidden_act!r} (only "
                                  f"{self.expert_kind.hidden_act!r} is supported with "
                                  f"{self.expert_activation} experts)")
        self.stacks.check(self)
        if self.norm not in ("rms", "layer"):
            raise CheckpointError(f"config: norm={self.norm!r} (expected one of ('rms', 'layer'))")
        self.routing.check(self)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's spec: every field under its name; each part (the router, the expert kind, the
        rotary embedding, the attention, the stacks) as its kind under the part's key ("router",
        "expert_activation", "rope_type", "attention", "stacks") and its parameters."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PARTS}
        for name in PARTS:
            d.update(getattr(self, name).spec_fields())
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        from .models import part_from_fields   # the kinds are declared by the architecture files
        from .models import common

        d = dict(d)
        for name, part in PARTS.items():
            d[name] = part_from_fields(d, getattr(common, part))
        d["moe_layers"] = tuple(d["moe_layers"])
        d["sliding_windows"] = tuple(d["sliding_windows"])
        return cls(**d)

    @property
    def expert_activation(self) -> str:
        """The expert kind's name ("swiglu", "gpt_oss", "relu")."""
        return self.expert_kind.kind

    @property
    def router(self) -> str:
        """The router's kind ("softmax", "sigmoid_group", ...; decode.ROUTERS: those the engine computes)."""
        return self.routing.kind

    @property
    def key_dim(self) -> int:
        """Dims per head of queries and keys (and of the KV cache's keys)."""
        return self.attention.key_dim(self)

    @property
    def cache_layout(self) -> tuple[int, int, int]:
        """The KV cache's (heads, key dims, value dims) per layer and position (MLA: its latent)."""
        return self.attention.cache_layout(self)

    @property
    def rope_dim(self) -> int:
        """Dims per head that the rotary embedding turns (MLA: only the rope part)."""
        return self.attention.rope_dim(self)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.stacks.encoder_layers > 0

    @property
    def expert_roles(self) -> tuple[str, ...]:
        return self.expert_kind.roles

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical dense role this model has, with its shape."""
        if self.is_encoder_decoder:
            return self.stacks.dense_shapes(self)
        D, V = self.hidden_size, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"embed": (V, D), "norm": (D,)}
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (V, D)
        if self.lm_head_bias:
            shapes["lm_head_bias"] = (V,)
        norms = ["norm"]
        for l in range(self.num_layers):
            p = f"layers.{l}."
            shapes.update({p + "attn_norm": (D,), p + "mlp_norm": (D,)})
            norms += [p + "attn_norm", p + "mlp_norm"]
            shapes.update({p + role: shape for role, shape in self.attention.shapes(self).items()})
            shapes.update({p + role: shape for role, shape in self._mlp_shapes(l).items()})
        if self.norm == "layer":
            shapes.update({name + "_bias": (D,) for name in norms})
        return shapes

    def _mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        D = self.hidden_size
        if not self.moe_layers[layer]:
            F = self.dense_hidden
            return {"mlp.gate": (F, D), "mlp.up": (F, D), "mlp.down": (D, F)}
        shapes: dict[str, tuple[int, ...]] = {"router": (self.num_experts, D)}
        if self.routing.has_bias:
            shapes["router_bias"] = (self.num_experts,)
        shapes.update(self.expert_kind.dense_shapes(self))
        if self.shared_expert_hidden:
            S = self.shared_expert_hidden
            shapes.update({"shared.gate": (S, D), "shared.up": (S, D), "shared.down": (D, S)})
            if self.shared_expert_gated:
                shapes["shared_gate"] = (1, D)
        return shapes

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        I, D = self.expert_hidden, self.hidden_size
        shapes = {"gate": (I, D), "up": (I, D), "down": (D, I)}
        return {role: shapes[role] for role in self.expert_roles}

    @property
    def moe_layer_ids(self) -> list[int]:
        return [l for l, moe in enumerate(self.moe_layers) if moe]


@dataclass(frozen=True)
class ExpertNames:
    """Where one MoE layer's experts live in a checkpoint.

    Per-expert layout: f"{prefix}.{expert_prefix}{e}.{gate}" etc. (Mixtral: w1/w3/w2; Qwen, OLMoE: gate_proj/
    up_proj/down_proj, each + ".weight"; Switch: expert_{e}.wi / .wo, no gate). Fused layout (transformers 5 in memory, some checkpoints on disk):
    f"{prefix}.gate_up_proj" [E, 2I, D] (gate rows first) and f"{prefix}.down_proj" [E, D, I].
    GPT-OSS's fused layout (fused="gpt_oss"): gate_up_proj [E, D, 2I] with gate and up interleaved
    along the last axis (gate at even indices) and down_proj [E, I, D], both transposed against
    nn.Linear; or, MXFP4-quantized, f"{prefix}.gate_up_proj_blocks" [E, 2I, D/32, 16] with
    "_scales" [E, 2I, D/32] (rows interleaved, not transposed) and down_proj_blocks / _scales
    [E, D, I/32, 16] / [E, D, I/32] (edgemoe/mxfp4.py).
    """

    prefix: str
    gate: str | None            # None: an ungated expert
    up: str
    down: str
    fused: str = "stacked"      # the fused layout this checkpoint family uses: "stacked" or "gpt_oss"
    expert_prefix: str = ""

    def per_expert(self, e: int) -> dict[str, str]:
        return {role: f"{self.prefix}.{self.expert_prefix}{e}.{name}" for role, name in
                (("gate", self.gate), ("up", self.up), ("down", self.down)) if name is not None}

    @property
    def fused_gate_up(self) -> str:
        return f"{self.prefix}.gate_up_proj"

    @property
    def fused_down(self) -> str:
        return f"{self.prefix}.down_proj"


@dataclass(frozen=True)
class TensorNames:
    """An architecture's checkpoint names: canonical dense role -> name, MoE layer -> expert names."""

    dense: dict[str, str]
    experts: dict[int, ExpertNames] = field(default_factory=dict)
    # Checkpoint tensors that carry no weights we need (e.g. cached rotary frequencies, DeepSeek-V3's
    # multi-token prediction layers).
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    ignored_prefixes: tuple[str, ...] = ()


def _typed(config: dict, keys: tuple[str, ...], default: Any, section: str, valid, expected: str) -> Any:
    """The one reader of config.json fields (config_int, config_float, ...): the first of `keys` present
    and not null; else `default`, returned as it is (None makes a field optional), or an error if there
    is none. Refused unless valid(value), naming the field (in `section`, e.g. rope_parameters), the
    value and what was `expected`."""
    prefix = section + "." if section else ""
    key = next((key for key in keys if config.get(key) is not None), None)
    if key is None:
        if default is ...:
            raise CheckpointError(f"missing {' / '.join(prefix + k for k in keys)}")
        return default
    if not valid(config[key]):
        raise CheckpointError(f"{prefix}{key}={config[key]!r}: expected {expected}")
    return config[key]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return _is_int(value) or isinstance(value, float) and math.isfinite(value)


def config_int(config: dict, *keys: str, default: Any = ..., minimum: int = 1, section: str = "") -> Any:
    """An integer field (a JSON integer: a bool, a float or a string is refused) of at least `minimum`."""
    return _typed(config, keys, default, section, lambda v: _is_int(v) and v >= minimum, f"an integer >= {minimum}")


def config_float(config: dict, *keys: str, default: Any = ..., above: float | None = None,
                 minimum: float | None = None, section: str = "") -> Any:
    """A number field (an integer or a finite float; a bool or a string is not), greater than `above`
    or at least `minimum`; returned as a float."""
    bound = f" > {above}" if above is not None else f" >= {minimum}" if minimum is not None else ""
    value = _typed(config, keys, default, section,
                   lambda v: _is_number(v) and (above is None or v > above) and (minimum is None or v >= minimum),
                   f"a number{bound}")
    return None if value is None else float(value)


def config_bool(config: dict, key: str, default: Any = ..., section: str = "") -> Any:
    """A flag: JSON true or false (a string "false" would be truthy: refused)."""
    return _typed(config, (key,), default, section, lambda v: isinstance(v, bool), "true or false")


def config_str(config: dict, *keys: str, default: Any = ..., section: str = "") -> Any:
    return _typed(config, keys, default, section, lambda v: isinstance(v, str), "a string")


def config_list(config: dict, key: str, item: str, default: Any = ..., section: str = "") -> Any:
    """A list whose items are all of one `item` kind: "integer", "number" or "string"."""
    kinds = {"integer": _is_int, "number": _is_number, "string": lambda v: isinstance(v, str)}
    return _typed(config, (key,), default, section, lambda v: isinstance(v, list) and all(map(kinds[item], v)),
                  f"a list of {item}s")


def config_object(config: dict, key: str, default: Any = ..., section: str = "") -> Any:
    return _typed(config, (key,), default, section, lambda v: isinstance(v, dict), "an object")


def rope_parameters(config: dict) -> dict:
    """The rotary parameters of a config of transformers 5 (rope_parameters) or 4 (rope_scaling, with
    rope_theta at the top level), with "rope_type" always set; "field" names where they came from."""
    for field_name in ("rope_parameters", "rope_scaling"):
        params = config_object(config, field_name, default=None)
        if params:
            kind = config_str(params, "rope_type", "type", default="default", section=field_name)
            return {**params, "rope_type": kind, "field": field_name}
    return {"rope_type": "default", "field": "rope_parameters"}


def rope_theta(config: dict, supported: tuple[str, ...] = ("default",)) -> float:
    """rope_theta from a config of transformers 4 (top level) or 5 (rope_parameters); a rotary type
    outside `supported` is refused, naming the field."""
    params = rope_parameters(config)
    if params["rope_type"] not in supported:
        raise CheckpointError(f"{params['field']} type {params['rope_type']!r} is not supported "
                              f"(supported: {', '.join(repr(t) for t in supported)})")
    # A base of 1 or less would not slow the rotation from one dim pair to the next (and YaRN divides by its log).
    theta = config_float(params, "rope_theta", default=None, above=1, section=params["field"])
    return theta if theta is not None else config_float(config, "rope_theta", default=10000.0, above=1)
