"""The encoder-decoder MoE model (Switch Transformers): dense weights resident, experts behind an
ExpertProvider, as MoEModel, whose decoder-only path this module leaves alone.

T5's structure: RMS norms without mean or bias before each sub-layer, attention without 1/sqrt(Dh)
scaling whose positions enter only as a learned bias per relative-position bucket and head (the bias
lives in the first layer of each stack and every layer of the stack adds it; buckets are bidirectional
in the encoder, causal in the decoder), cross-attention in each decoder layer over the encoder's
output, and, with tied embeddings, the decoder output scaled by D**-0.5 before the LM head.

Generation goes through generate's loop (open_sequence, next_logits): the encoder runs once over the
prompt; its output's cross-attention keys and values are computed once per decoder layer
(DecoderState); then the decoder runs one token per step from decoder_start_token_id with a KV cache
for its self-attention.

Feed-forward: a dense ungated relu MLP, or (spec.moe_layers) top-1 routing: the router's float32
softmax picks the argmax expert and scales its output by that probability. As transformers does in
eval mode too, an expert takes at most spec.stacks.expert_capacity tokens of a pass (the encoder's over the
prompt, a decoder step's): later tokens routed to a full expert get no MoE output (their residual
passes). A one-token decoder step never reaches the capacity.

Layer indices: encoder layers 0..Le-1, decoder layers Le..num_layers-1 (one (layer, expert) key space).

Text as text-to-text (the budget's calibration loss, routing profiles): a window of consecutive tokens
is split by text_to_text into the encoder's input (its first half) and the decoder's target (the
second half), which the decoder reads teacher-forced: decoder_start_token_id, then the target but its
last token, each position predicting the next target token.

Shapes: S prompt tokens, T tokens of a pass, L cached decoder length, D hidden, V vocab, H heads,
Dh head dim, B relative-position buckets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import EdgeMoEError
from .decode import EncoderDecoderEngine
from .dense import quantize_layer, quantize_matrix
from .experts import ExpertBatches, ExpertProvider
from .kernels.activations import relu_expert
from .kv_cache import KVCache
from .layers import attend, linear, rms_norm
from .model import StoreOwner, Timings
from .spec import ModelSpec
from .threads import ThreadGovernor


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of each key position minus query position (int64): half the buckets (per direction
    when bidirectional) exact for small distances, the rest log-spaced up to max_distance, beyond
    which the last bucket holds."""
    offset = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        offset = (relative > 0).long() * buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)     # keys after the query are masked anyway
    exact = buckets // 2
    # log(0) is -inf for distance 0; torch.where takes the exact bucket there.
    log_spaced = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                          * (buckets - exact)).long()
    return offset + torch.where(distance < exact, distance, log_spaced.clamp(max=buckets - 1))


def position_bias(table: torch.Tensor, query_positions: torch.Tensor, key_length: int,
                  bidirectional: bool, max_distance: int) -> torch.Tensor:
    """Additive attention bias [H, T, L] from a stack's table [B, H]; causal stacks get -inf past each query."""
    relative = torch.arange(key_length)[None, :] - query_positions[:, None]          # [T, L]
    bias = table[relative_position_bucket(relative, bidirectional, table.shape[0], max_distance)]
    bias = bias.permute(2, 0, 1).float()
    return bias if bidirectional else bias.masked_fill(relative[None] > 0, float("-inf"))


@dataclass(frozen=True)
class TextToText:
    """One window as text-to-text: source [S] (the encoder's input), decoder_input [T], target [T]."""

    source: torch.Tensor
    decoder_input: torch.Tensor
    target: torch.Tensor


def text_to_text(window: torch.Tensor, decoder_start_token_id: int) -> TextToText:
    """Split a window of >= 2 token ids: first half the source, second half the target (teacher-forced)."""
    if window.numel() < 2:
        raise ValueError(f"text-to-text window: {window.numel()} token(s), expected at least 2")
    half = window.numel() // 2
    source, target = window[:half], window[half:]
    decoder_input = torch.cat([torch.tensor([decoder_start_token_id], dtype=target.dtype), target[:-1]])
    return TextToText(source, decoder_input, target)


@dataclass
class DecoderState:
    """One generation's decoder memory: the self-attention cache of the decoder layers and, per
    decoder layer, the cross-attention keys and values of the encoder output [H, S, Dh]."""

    cache: KVCache
    cross: list[tuple[torch.Tensor, torch.Tensor]]


class Seq2SeqModel(StoreOwner):
    dense_bits: int | None = None   # the dense projections' width once quantized (quantize_dense)

    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], experts: ExpertProvider,
                 tokenizer=None, generation_config: dict | None = None, name: str = "",
                 threads: int | None = None, store=None, preload: str = "none"):
        """As MoEModel's: store is owned by the model from now on (close()); preload: its predictor."""
        if not spec.is_encoder_decoder:
            raise EdgeMoEError(f"{name or spec.model_type}: Seq2SeqModel needs an encoder-decoder spec")
        self._hold(spec, experts, store, tokenizer, generation_config, name)
        self.embed = dense["embed"]
        self.enc_embed = dense.get("enc_embed", self.embed)
        self.lm_head = dense["embed"] if spec.tie_word_embeddings else dense["lm_head"]
        self.enc_norm, self.final_norm = dense["enc_norm"], dense["norm"]
        self.layers = [{key.split(".", 2)[2]: t for key, t in dense.items() if key.startswith(f"layers.{l}.")}
                       for l in range(spec.num_layers)]
        self.stacks = spec.stacks   # the encoder-decoder's parameters (models/switch_transformers.py)
        self.encoder_range = range(self.stacks.encoder_layers)
        self.decoder_range = range(self.stacks.encoder_layers, spec.num_layers)
        # The hooks of MoEModel (see there): routing observers and the MoE-input look-ahead.
        self.routing_hooks: list = []
        self.moe_input_hooks: list = []
        self.timings = Timings()
        self.threads = ThreadGovernor(threads)
        self.context_length = spec.max_position_embeddings
        self._start_preloader(store, preload)
        # One-token decoder steps run each decoder layer's attention blocks (and dense MLP) in one kernel
        # call where the projections are quantized (edgemoe/decode.py); None: the generic forward.
        self.decode_engine = EncoderDecoderEngine.for_model(spec, self.layers, self._bias_by_distance())

    # ---- public API -------------------------------------------------------------------------------
    def quantize_dense(self, bits: int) -> None:
        """Quantize both stacks' projections (self-attention's q, k, v stacked as "qkv", cross-attention's,
        the dense MLPs') and an untied LM head to `bits` (edgemoe.dense), in place; the embeddings stay
        as loaded (a tied LM head gets a quantized copy)."""
        self.layers = [quantize_layer(w, bits) for w in self.layers]
        self.lm_head = quantize_matrix(self.lm_head, bits)
        self.dense_bits = bits
        self.decode_engine = EncoderDecoderEngine.for_model(self.spec, self.layers, self._bias_by_distance())

    @torch.inference_mode()
    def encode(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The encoder's output [S, D] (after its final norm) for a 1-D run of prompt tokens."""
        tokens = self._checked_tokens(token_ids, "encode")
        start = time.perf_counter()
        x = self.enc_embed[tokens].to(self.dtype)
        positions = torch.arange(tokens.numel())
        bias = position_bias(self.layers[0]["rel_bias"], positions, tokens.numel(), True,
                             self.stacks.relative_attention_max_distance)
        for l in self.encoder_range:
            w = self.layers[l]
            t0 = time.perf_counter()
            q, k, v = self._self_qkv(w, rms_norm(x, w["attn_norm"], self.spec.rms_norm_eps))
            x = x + self._attend(w, "", q, k, v, bias)
            t1 = time.perf_counter()
            x = x + self._feed_forward(l, w, rms_norm(x, w["mlp_norm"], self.spec.rms_norm_eps), positions)
            self.timings.attention += t1 - t0
            self.timings.experts += time.perf_counter() - t1
        self._count_step(tokens.numel(), start)
        return rms_norm(x, self.enc_norm, self.spec.rms_norm_eps)

    @torch.inference_mode()
    def start(self, encoder_output: torch.Tensor) -> DecoderState:
        """A fresh decoder state over `encoder_output` [S, D]: cross-attention keys and values, once."""
        cross = [(self._heads(linear(encoder_output, self.layers[l]["cross.k"])).contiguous(),
                  self._heads(linear(encoder_output, self.layers[l]["cross.v"])).contiguous())
                 for l in self.decoder_range]
        s = self.spec
        cache = KVCache(len(self.decoder_range), s.num_heads, s.head_dim, dtype=self.dtype)
        return DecoderState(cache, cross)

    @torch.inference_mode()
    def decode(self, token_ids: Sequence[int] | torch.Tensor, state: DecoderState) -> torch.Tensor:
        """float32 logits [T, V] for decoder tokens continuing `state` (which advances by T)."""
        tokens = self._checked_tokens(token_ids, "decode")
        start = time.perf_counter()
        if self.decode_engine is not None and tokens.numel() == 1:
            return self._decode_by_engine(tokens, state, start)
        cache, s = state.cache, self.spec
        positions = torch.arange(cache.length, cache.length + tokens.numel())
        bias = position_bias(self.layers[self.stacks.encoder_layers]["rel_bias"], positions,
                             cache.length + tokens.numel(), False, self.stacks.relative_attention_max_distance)
        x = self.embed[tokens].to(self.dtype)
        for j, l in enumerate(self.decoder_range):
            w = self.layers[l]
            t0 = time.perf_counter()
            q, k, v = self._self_qkv(w, rms_norm(x, w["attn_norm"], s.rms_norm_eps))
            x = x + self._attend(w, "", q, *cache.append(j, k, v), bias)
            x = x + self._attend(w, "cross.", self._query(w, "cross.q", rms_norm(x, w["cross_norm"], s.rms_norm_eps)),
                                 *state.cross[j], None)
            t1 = time.perf_counter()
            x = x + self._feed_forward(l, w, rms_norm(x, w["mlp_norm"], s.rms_norm_eps), positions)
            self.timings.attention += t1 - t0
            self.timings.experts += time.perf_counter() - t1
        cache.advance(tokens.numel())
        logits = self._head(x)
        self._count_step(tokens.numel(), start)
        return logits

    def _decode_by_engine(self, token: torch.Tensor, state: DecoderState, start: float) -> torch.Tensor:
        """decode() of one token by the decode engine: each decoder layer's attention blocks (and dense
        MLP) in one kernel call, its MoE block in one more where every expert is resident, else the
        generic MoE block on the engine's routing."""
        engine, cache = self.decode_engine, state.cache
        positions = torch.tensor([cache.length])
        x = self.embed[token].to(self.dtype)
        for j, l in enumerate(self.decoder_range):
            t0 = time.perf_counter()
            x, h, logits = engine.layer(l, x, cache.length, cache, state.cross[j])
            t1 = time.perf_counter()
            if logits is not None:
                x = self._engine_moe(l, x, h, logits, positions)
            self.timings.attention += t1 - t0
            self.timings.experts += time.perf_counter() - t1
        cache.advance(1)
        logits = self._head(x)
        self._count_step(1, start)
        return logits

    def _engine_moe(self, l: int, x: torch.Tensor, h: torch.Tensor, logits: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        """Layer l's MoE block after the engine's attention blocks: by the engine in one call where every
        expert is resident (x updated in place), else by the generic block on the engine's routing: the
        same bits either way."""
        layouts = self.experts.resident_layouts(l) if self.decode_engine.computes_moe(l) else None
        if layouts is None:
            return x + self._feed_forward(l, self.layers[l], h, positions, logits)
        for hook in self.moe_input_hooks:
            hook(l, h)
        weights, experts = self.decode_engine.moe(l, x, h, logits, layouts)
        self.experts.served_resident(l, [sorted(set(experts[0].tolist()))])
        for hook in self.routing_hooks:
            hook(l, experts, weights, positions, ())
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder's final norm and LM head: hidden [T, D] -> float32 logits [T, V]."""
        s = self.spec
        x = rms_norm(x, self.final_norm, s.rms_norm_eps)
        if s.tie_word_embeddings:
            x = x * s.hidden_size ** -0.5    # T5 rescales before the LM head that is the embedding
        return linear(x, self.lm_head).float()

    def _bias_by_distance(self) -> torch.Tensor:
        """The decoder's relative-position bias [H, C] of a key d = 0 .. C - 1 positions before its
        query, C = max_distance + 1: every longer distance falls in the last bucket, as d = C - 1 does."""
        distances = torch.arange(self.stacks.relative_attention_max_distance + 1)
        table = self.layers[self.stacks.encoder_layers]["rel_bias"]
        buckets = relative_position_bucket(-distances, False, table.shape[0],
                                           self.stacks.relative_attention_max_distance)
        return table[buckets].T.float()

    def dense_weights(self) -> dict[str, torch.Tensor]:
        """The dense weights under their canonical names (to build a twin with other experts)."""
        dense = {"embed": self.embed, "enc_norm": self.enc_norm, "norm": self.final_norm}
        if self.enc_embed is not self.embed:
            dense["enc_embed"] = self.enc_embed
        if not self.spec.tie_word_embeddings:
            dense["lm_head"] = self.lm_head
        for l, weights in enumerate(self.layers):
            dense.update({f"layers.{l}.{name}": t for name, t in weights.items()})
        return dense

    def logits(self, input_ids: Sequence[int], decoder_ids: Sequence[int]) -> torch.Tensor:
        """Decoder logits [T, V] for decoder_ids given the prompt input_ids (one decoder pass)."""
        return self.decode(decoder_ids, self.start(self.encode(input_ids)))

    def teacher_forced(self, pair: TextToText) -> torch.Tensor:
        """Decoder logits [T, V] of a text-to-text window: row t predicts pair.target[t]."""
        return self.logits(pair.source, pair.decoder_input)

    def route(self, l: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's top-1 router on its MoE input x [T, D] -> (weights [T, 1] float32, experts [T, 1]):
        the argmax of the float32 softmax and its probability."""
        probs = torch.softmax(torch.nn.functional.linear(x.float(), self.layers[l]["router"].float()), dim=-1)
        weights, experts = probs.max(dim=-1, keepdim=True)
        return weights, experts

    # ---- the generation loop's entry points (generate.py) -----------------------------------------
    def open_sequence(self, prompt_ids: Sequence[int],
                      output_ids: Sequence[int] = ()) -> tuple[DecoderState, list[int]]:
        """A new sequence's decoding state (the encoder's output over the prompt, read once) and the
        tokens it feeds first: the decoder's start token, and the output already chosen where a
        suspended sequence opens again."""
        return self.start(self.encode(prompt_ids)), [self.stacks.decoder_start_token_id, *output_ids]

    def next_logits(self, runs: Sequence[Sequence[int]], states: Sequence[DecoderState]) -> torch.Tensor:
        """Each state's decoder continued by its run of tokens; the float32 logits [len(runs), V] of each
        run's last token (one decoder pass per sequence)."""
        return torch.cat([self.decode(run, state)[-1:] for run, state in zip(runs, states)])

    # ---- layers -----------------------------------------------------------------------------------
    def _checked_tokens(self, token_ids, what: str) -> torch.Tensor:
        tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if tokens.numel() == 0:
            raise ValueError(f"{what}: token_ids is empty")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.spec.vocab_size:
            raise ValueError(f"{what}: token id outside [0, {self.spec.vocab_size})")
        self.threads.step()
        return tokens

    def _count_step(self, tokens: int, start: float) -> None:
        elapsed = time.perf_counter() - start
        t = self.timings
        t.steps += 1
        t.tokens += tokens
        t.total += elapsed
        t.per_step.append((tokens, elapsed))

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        """[T, H*Dh] -> [H, T, Dh]."""
        return y.view(y.shape[0], self.spec.num_heads, self.spec.head_dim).transpose(0, 1)

    def _self_qkv(self, w: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention's q [T, H, Dh], k and v [H, T, Dh] of h [T, D]: from q, k, v, or from "qkv",
        their rows stacked where the dense matrices are quantized (edgemoe.dense.quantize_layer)."""
        if "qkv" not in w:
            return self._query(w, "q", h), self._heads(linear(h, w["k"])), self._heads(linear(h, w["v"]))
        q, k, v = linear(h, w["qkv"]).chunk(3, dim=-1)
        return q.reshape(h.shape[0], self.spec.num_heads, self.spec.head_dim), self._heads(k), self._heads(v)

    def _query(self, w: dict, name: str, h: torch.Tensor) -> torch.Tensor:
        """Queries [T, H, Dh] of h [T, D] by w[name]."""
        return self._heads(linear(h, w[name])).transpose(0, 1)

    def _attend(self, w: dict, prefix: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """Attention of queries q [T, H, Dh] over keys, values [H, L, Dh], plus bias (T5's scale: 1,
        q.k unscaled), through w[prefix + "o"]."""
        scale = self.spec.attention.softmax_scale(self.spec)
        return linear(attend(q, keys, values, bias, scale=scale), w[prefix + "o"])

    def _feed_forward(self, l: int, w: dict, h: torch.Tensor, positions: torch.Tensor,
                      router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP or MoE block on h [T, D]; router_logits: the decode engine's for one token (its
        router then chooses: the bits of its moe())."""
        if not self.spec.moe_layers[l]:
            return relu_expert(h, lambda x, role: linear(x, w["mlp." + role]))
        for hook in self.moe_input_hooks:
            hook(l, h)
        if router_logits is not None:
            weights, experts = self.decode_engine.choose(router_logits, None)
        else:
            weights, experts = self.route(l, h)
        batches = self._within_capacity(weights, experts)
        self.experts.prepare(l, batches)
        for hook in self.routing_hooks:
            hook(l, experts, weights, positions, ())
        return self.experts.run(l, h, batches)

    def _within_capacity(self, weights: torch.Tensor, experts: torch.Tensor) -> ExpertBatches:
        """The pass's routing [T, 1] grouped by expert, without the tokens past an expert's capacity
        (each expert keeps its first expert_capacity tokens in order)."""
        capacity = self.stacks.expert_capacity
        if capacity is None or experts.shape[0] <= capacity:
            return ExpertBatches.from_routing(weights, experts)
        one_hot = torch.nn.functional.one_hot(experts[:, 0], self.spec.num_experts)     # [T, E]
        rank = (one_hot.cumsum(0) * one_hot).sum(-1)                                     # 1-based, per expert
        kept = torch.nonzero(rank <= capacity).reshape(-1)
        batches = ExpertBatches.from_routing(weights[kept], experts[kept])
        return ExpertBatches.from_lists(batches.experts, [kept[t] for t in batches.tokens], batches.weights)
