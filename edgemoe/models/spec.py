"""What every architecture file produces: a ModelSpec and the map from canonical roles to checkpoint names.

The runtime, the store and the converter speak only canonical names; each architecture file is the one
place where its checkpoint's names are mapped to them.

Canonical dense roles (shapes; D hidden, V vocab, H heads, K kv heads, Dh head dim, F dense MLP hidden,
S shared-expert hidden, E experts):
    embed [V, D]   norm [D]   lm_head [V, D] (absent when tied to embed)
    layers.{l}.attn_norm [D]  .mlp_norm [D]
    layers.{l}.q [H*Dh, D]  .k [K*Dh, D]  .v [K*Dh, D]  .o [D, H*Dh]  (+ .q_bias .k_bias .v_bias)
    layers.{l}.q_norm / .k_norm  [Dh] ("head" norms) or [H*Dh] / [K*Dh] ("proj" norms)
    layers.{l}.router [E, D]
    layers.{l}.shared.gate / .up [S, D]  .shared.down [D, S]  .shared_gate [1, D]
    layers.{l}.mlp.gate / .up [F, D]  .mlp.down [D, F]       (dense-MLP layers)
Experts (I expert hidden): (layer, expert) -> gate [I, D], up [I, D], down [D, I].
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import CheckpointError


POSITIVE_INTEGERS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings", "num_experts", "top_k", "expert_hidden")


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
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    expert_hidden: int
    moe_layers: tuple[bool, ...]          # per layer: MoE block (True) or dense MLP (False)
    sliding_windows: tuple[int | None, ...]  # per layer: attention window, None = full
    dense_hidden: int = 0
    shared_expert_hidden: int = 0         # 0: no shared expert
    qkv_bias: bool = False
    qk_norm: str | None = None            # None, "head" (per head, Qwen3) or "proj" (whole projection, OLMoE)
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

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
        if self.hidden_act != "silu":
            raise CheckpointError(f"config: hidden_act={self.hidden_act!r} (only 'silu' is supported)")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        d = dict(d)
        d["moe_layers"] = tuple(d["moe_layers"])
        d["sliding_windows"] = tuple(d["sliding_windows"])
        return cls(**d)

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical dense role this model has, with its shape."""
        D, Dh = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * Dh, self.num_kv_heads * Dh
        shapes: dict[str, tuple[int, ...]] = {"embed": (self.vocab_size, D), "norm": (D,)}
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (self.vocab_size, D)
        for l in range(self.num_layers):
            p = f"layers.{l}."
            shapes.update({p + "attn_norm": (D,), p + "mlp_norm": (D,), p + "q": (q_out, D),
                           p + "k": (kv_out, D), p + "v": (kv_out, D), p + "o": (D, q_out)})
            if self.qkv_bias:
                shapes.update({p + "q_bias": (q_out,), p + "k_bias": (kv_out,), p + "v_bias": (kv_out,)})
            if self.qk_norm == "head":
                shapes.update({p + "q_norm": (Dh,), p + "k_norm": (Dh,)})
            elif self.qk_norm == "proj":
                shapes.update({p + "q_norm": (q_out,), p + "k_norm": (kv_out,)})
            if self.moe_layers[l]:
                shapes[p + "router"] = (self.num_experts, D)
                if self.shared_expert_hidden:
                    S = self.shared_expert_hidden
                    shapes.update({p + "shared.gate": (S, D), p + "shared.up": (S, D),
                                   p + "shared.down": (D, S), p + "shared_gate": (1, D)})
            else:
                F = self.dense_hidden
                shapes.update({p + "mlp.gate": (F, D), p + "mlp.up": (F, D), p + "mlp.down": (D, F)})
        return shapes

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        I, D = self.expert_hidden, self.hidden_size
        return {"gate": (I, D), "up": (I, D), "down": (D, I)}

    @property
    def moe_layer_ids(self) -> list[int]:
        return [l for l, moe in enumerate(self.moe_layers) if moe]


@dataclass(frozen=True)
class ExpertNames:
    """Where one MoE layer's experts live in a checkpoint.

    Per-expert layout: f"{prefix}.{e}.{gate}" etc. (Mixtral: w1/w3/w2; Qwen, OLMoE: gate_proj/up_proj/
    down_proj, each + ".weight"). Fused layout (transformers 5 in memory, some checkpoints on disk):
    f"{prefix}.gate_up_proj" [E, 2I, D] (gate rows first) and f"{prefix}.down_proj" [E, D, I].
    """

    prefix: str
    gate: str
    up: str
    down: str

    def per_expert(self, e: int) -> dict[str, str]:
        return {role: f"{self.prefix}.{e}.{name}" for role, name in
                (("gate", self.gate), ("up", self.up), ("down", self.down))}

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
    # Checkpoint tensors that carry no weights we need (e.g. cached rotary frequencies).
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)


def config_value(config: dict, *keys: str, default: Any = ...) -> Any:
    """The first of `keys` present in a HF config dict; a clear error if none is and no default."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    if default is ...:
        raise CheckpointError(f"config.json: missing {' / '.join(keys)}")
    return default


def rope_theta(config: dict) -> float:
    """rope_theta from a config of transformers 4 (top level) or 5 (rope_parameters)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"config.json: rope type {rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
