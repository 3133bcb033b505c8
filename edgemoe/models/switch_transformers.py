"""Switch Transformers: a T5 encoder-decoder whose feed-forward blocks are, every few layers, top-1 MoE
blocks of ungated relu experts (wo(relu(wi x))); run by edgemoe.seq2seq.Seq2SeqModel.

A stack's layer i is MoE when i % step == 1 or step == 1 (step = its layer count // its number of sparse
layers, or its layer count when that is 0): transformers' rule, which also decides what its checkpoints
hold. Encoder layer i is ModelSpec layer i, decoder layer j is layer num_layers + j (one expert key space).

Checkpoint names (stack s = encoder / decoder, block i):
    shared.weight (embeddings of both stacks when tied), untied: {s}.embed_tokens.weight (each stack its own,
    as transformers 5 unties them) and lm_head.weight; {s}.final_layer_norm.weight,
    {s}.block.{i}.layer.0.layer_norm.weight, .layer.0.SelfAttention.{q,k,v,o}.weight,
    {s}.block.0.layer.0.SelfAttention.relative_attention_bias.weight [B, H],
    decoder: .layer.1.layer_norm.weight, .layer.1.EncDecAttention.{q,k,v,o}.weight;
    the last sub-layer f (1 encoder, 2 decoder): .layer.{f}.layer_norm.weight, dense .layer.{f}.mlp.wi / wo
    .weight, or MoE .layer.{f}.mlp.router.classifier.weight and .layer.{f}.mlp.experts.expert_{e}.wi / wo .weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import Attention, ExpertKind, Rotary, SoftmaxTopK, Stacks, register
from ..errors import CheckpointError
from ..spec import ExpertNames, ModelSpec, TensorNames, config_bool, config_float, config_int, config_str

MODEL_TYPE = "switch_transformers"
# T5 has no position embeddings; the context is bounded only by memory. This is the length the released
# models were trained on (the T5 / Switch papers' 512 input tokens), used as edgemoe's context limit.
CONTEXT_LENGTH = 512


@register
@dataclass(frozen=True, kw_only=True)
class EncoderDecoder(Stacks):
    """T5's stacks: the first encoder_layers of num_layers are the encoder's, the rest the decoder's,
    whose first token is decoder_start_token_id; each stack's first layer holds the relative-position
    bias of its B buckets, the last of which starts at relative_attention_max_distance; an expert takes
    at most expert_capacity tokens of a pass (None: no limit), those beyond pass it by."""

    kind = "encoder_decoder"
    encoder_layers: int
    relative_attention_buckets: int
    relative_attention_max_distance: int
    decoder_start_token_id: int | None
    expert_capacity: int | None

    def check(self, spec) -> None:
        if not 0 < self.encoder_layers < spec.num_layers:
            raise CheckpointError(f"config: {self.encoder_layers} encoder layers of {spec.num_layers} leave no decoder")
        if self.relative_attention_buckets < 2 or self.relative_attention_max_distance < 1:
            raise CheckpointError(f"config: relative_attention_num_buckets={self.relative_attention_buckets}, "
                                  f"relative_attention_max_distance={self.relative_attention_max_distance}")
        if self.decoder_start_token_id is None or not 0 <= self.decoder_start_token_id < spec.vocab_size:
            raise CheckpointError(f"config: decoder_start_token_id={self.decoder_start_token_id!r} "
                                  f"outside [0, {spec.vocab_size})")
        if self.expert_capacity is not None and self.expert_capacity < 1:
            raise CheckpointError(f"config: expert_capacity={self.expert_capacity} (expected >= 1)")

    def dense_shapes(self, spec) -> dict[str, tuple[int, ...]]:
        """Every canonical dense role of the model (edgemoe/spec.py, encoder-decoder models) with its shape."""
        D, V, inner = spec.hidden_size, spec.vocab_size, spec.num_heads * spec.head_dim
        shapes: dict[str, tuple[int, ...]] = {"embed": (V, D), "enc_norm": (D,), "norm": (D,)}
        if not spec.tie_word_embeddings:
            shapes.update(lm_head=(V, D), enc_embed=(V, D))
        attention = {"q": (inner, D), "k": (inner, D), "v": (inner, D), "o": (D, inner)}
        for l in range(spec.num_layers):
            p = f"layers.{l}."
            shapes.update({p + "attn_norm": (D,), p + "mlp_norm": (D,)})
            shapes.update({p + role: shape for role, shape in attention.items()})
            if l in (0, self.encoder_layers):
                shapes[p + "rel_bias"] = (self.relative_attention_buckets, spec.num_heads)
            if l >= self.encoder_layers:
                shapes[p + "cross_norm"] = (D,)
                shapes.update({p + "cross." + role: shape for role, shape in attention.items()})
            if spec.moe_layers[l]:
                shapes[p + "router"] = (spec.num_experts, D)
            else:
                shapes.update({p + "mlp.up": (spec.dense_hidden, D), p + "mlp.down": (D, spec.dense_hidden)})
        return shapes


@register
@dataclass(frozen=True)
class ReluExperts(ExpertKind):
    """Ungated relu experts, down(relu(up x)) (edgemoe/kernels/activations.py's relu_expert), with relu
    dense MLPs."""

    kind = "relu"
    roles = ("up", "down")
    hidden_act = "relu"


def sparse_flags(num_layers: int, num_sparse: int) -> tuple[bool, ...]:
    step = num_layers // num_sparse if num_sparse > 0 else num_layers
    return tuple(step > 0 and (i % step == 1 or step == 1) for i in range(num_layers))


def parse_config(config: dict) -> ModelSpec:
    if config_bool(config, "router_bias", default=False):
        raise CheckpointError("router_bias=true is not supported")
    if config_str(config, "dense_act_fn", default="relu") != "relu":
        raise CheckpointError(f"dense_act_fn={config['dense_act_fn']!r} (only 'relu' is supported)")
    if config_str(config, "router_dtype", default="float32") != "float32":
        raise CheckpointError(f"router_dtype={config['router_dtype']!r} (only 'float32' is supported)")
    encoder = config_int(config, "num_layers")
    decoder = config_int(config, "num_decoder_layers", default=encoder)
    flags = (sparse_flags(encoder, config_int(config, "num_sparse_encoder_layers", default=0, minimum=0))
             + sparse_flags(decoder, config_int(config, "num_sparse_decoder_layers", default=0, minimum=0)))
    heads = config_int(config, "num_heads")
    d_ff = config_int(config, "d_ff")
    return ModelSpec(
        model_type=MODEL_TYPE,
        vocab_size=config_int(config, "vocab_size"),
        hidden_size=config_int(config, "d_model"),
        num_layers=encoder + decoder,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=config_int(config, "d_kv"),
        rms_norm_eps=config_float(config, "layer_norm_epsilon", default=1e-6, above=0),
        rotary=Rotary(),               # unused: positions enter through the relative-position bias
        attention=Attention(attention_scale=1.0),   # T5's q, k, v, o, q.k unscaled (edgemoe/seq2seq.py)
        max_position_embeddings=CONTEXT_LENGTH,
        num_experts=config_int(config, "num_experts"),
        top_k=1,
        norm_topk_prob=False,
        routing=SoftmaxTopK(),
        expert_hidden=d_ff,
        moe_layers=flags,
        sliding_windows=(None,) * (encoder + decoder),
        dense_hidden=d_ff,
        tie_word_embeddings=config_bool(config, "tie_word_embeddings", default=True),
        hidden_act="relu",
        expert_kind=ReluExperts(),
        stacks=EncoderDecoder(
            encoder_layers=encoder,
            relative_attention_buckets=config_int(config, "relative_attention_num_buckets", default=32),
            relative_attention_max_distance=config_int(config, "relative_attention_max_distance", default=128),
            decoder_start_token_id=config_int(config, "decoder_start_token_id", "pad_token_id", minimum=0),
            expert_capacity=config_int(config, "expert_capacity", default=None)),
    )


def _stack_names(spec: ModelSpec, stack: str, first: int, count: int, names: dict[str, str]) -> dict:
    experts = {}
    ff = 2 if stack == "decoder" else 1
    for i in range(count):
        src, dst = f"{stack}.block.{i}.", f"layers.{first + i}."
        names[dst + "attn_norm"] = src + "layer.0.layer_norm.weight"
        for role in "qkvo":
            names[dst + role] = src + f"layer.0.SelfAttention.{role}.weight"
        if i == 0:
            names[dst + "rel_bias"] = src + "layer.0.SelfAttention.relative_attention_bias.weight"
        if stack == "decoder":
            names[dst + "cross_norm"] = src + "layer.1.layer_norm.weight"
            for role in "qkvo":
                names[dst + f"cross.{role}"] = src + f"layer.1.EncDecAttention.{role}.weight"
        names[dst + "mlp_norm"] = src + f"layer.{ff}.layer_norm.weight"
        mlp = src + f"layer.{ff}.mlp."
        if spec.moe_layers[first + i]:
            names[dst + "router"] = mlp + "router.classifier.weight"
            experts[first + i] = ExpertNames(mlp + "experts", None, "wi.weight", "wo.weight", expert_prefix="expert_")
        else:
            names[dst + "mlp.up"] = mlp + "wi.weight"
            names[dst + "mlp.down"] = mlp + "wo.weight"
    return experts


def tensor_names(spec: ModelSpec) -> TensorNames:
    names = {"enc_norm": "encoder.final_layer_norm.weight", "norm": "decoder.final_layer_norm.weight"}
    if spec.tie_word_embeddings:
        names["embed"] = "shared.weight"
        # Some checkpoints also save the tied embeddings under each stack's name.
        ignored = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    else:
        names.update(embed="decoder.embed_tokens.weight", enc_embed="encoder.embed_tokens.weight",
                     lm_head="lm_head.weight")
        ignored = ("shared.weight",)   # the model's input-embedding handle; each stack uses its own
    encoder = spec.stacks.encoder_layers
    experts = _stack_names(spec, "encoder", 0, encoder, names)
    experts.update(_stack_names(spec, "decoder", encoder, spec.num_layers - encoder, names))
    return TensorNames(names, experts, ignored_suffixes=ignored)
