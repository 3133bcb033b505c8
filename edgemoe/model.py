"""The MoE decoder: dense weights always resident, experts behind an ExpertProvider.

A step takes the new tokens of one or more sequences, flattened: tokens [T], with one Segment per
sequence (its KV cache and its run of tokens). Everything but attention works on the flat [T, D]
batch, so the expert path never depends on how many sequences, beams or positions arrive. With the
decode engine (quantized dense matrices), a step of several sequences is computed in parts, each as
in its own steps alone (StepParts): a sequence's logits are then the same bits whoever shares its
steps (docs/architecture.md, "Sequences decoded together").

The parts that differ between architectures are chosen by spec fields: the q/k/v projections by
spec.attention (edgemoe/attention.py), the router by spec.routing (edgemoe/models/), the norm kind
by spec.norm; shared experts (gated or not) and dense-MLP layers are dense weights like attention.

Shapes: T tokens in the step, D hidden, V vocab, H heads, K kv heads, Dk / Dv key / value dims per head,
S tokens of one sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .attention import ATTEND, QKV_PROJECTIONS
from .decode import DecodeEngine
from .dense import KERNEL_MAX_TOKENS, quantize_layer, quantize_matrix
from .experts import ExpertBatches, ExpertProvider
from .kv_cache import KVCache
from .layers import (attention_mask, layer_norm, linear, rms_norm, rope_tables,
                     route_by_spec, swiglu)
from .spec import ModelSpec
from .scheduling.preload import Preloader
from .threads import ThreadGovernor


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a step: its cache and how many of the step's tokens are its."""

    cache: KVCache
    num_tokens: int


@dataclass
class Timings:
    """Seconds spent per phase since the last reset (for --stats); experts include waiting for I/O."""

    attention: float = 0.0
    experts: float = 0.0
    layers: float = 0.0     # one-token steps whose every layer ran in one kernel call (not split)
    total: float = 0.0
    steps: int = 0
    tokens: int = 0
    per_step: list = field(default_factory=list)   # (tokens, seconds) of each forward step
    prefill_steps: int | None = None    # the steps run when the first new token was chosen

    @property
    def other(self) -> float:
        return self.total - self.attention - self.experts - self.layers

    def first_token_chosen(self) -> None:
        """The steps so far chose the first new token: they are the prefill, however many chunks the
        prompt took (the time to first token); later ones decode. Only the first call counts."""
        if self.prefill_steps is None:
            self.prefill_steps = len(self.per_step)

    def reset(self) -> None:
        self.__init__()


@dataclass(frozen=True)
class StepParts:
    """A step's rows in the parts computed apart, each as in its own steps alone, on a model that has
    the decode engine: the decoding rows (each its sequence's only token in the step), whose attention
    blocks the engine runs, then each longer run of one sequence (a prompt chunk)."""

    decoding: torch.Tensor                    # [n] int64: the decoding rows, ascending (n may be 0)
    runs: list[tuple[torch.Tensor, Segment]]  # each longer run's rows [S] and its segment, in step order
    part_of_row: np.ndarray                   # int64 [T]: 0 for a decoding row, i + 1 for run i's

    @classmethod
    def of(cls, segments: Sequence[Segment]) -> "StepParts":
        decoding, runs, part_of_row, at = [], [], [], 0
        for segment in segments:
            if segment.num_tokens == 1:
                decoding.append(at)
                part_of_row.append(0)
            else:
                runs.append((torch.arange(at, at + segment.num_tokens), segment))
                part_of_row += [len(runs)] * segment.num_tokens
            at += segment.num_tokens
        return cls(torch.tensor(decoding, dtype=torch.long), runs, np.array(part_of_row, np.int64))


# StepParts.of one token of one sequence: made once, the hot path asks every step
ONE_TOKEN = StepParts.of([Segment(None, 1)])

# Rows a product takes at once where each row must get the bits of its own one-token step: a quantized
# matrix multiplies up to this many on its integer kernel, which computes each row on its own (more go
# to a dequantized GEMM, which rounds otherwise).
ONE_TOKEN_ROWS = min(KERNEL_MAX_TOKENS.values())


def as_one_token_steps(function, x: torch.Tensor) -> torch.Tensor:
    """function (rows [S, D] -> [S, D']) on x [T, D], ONE_TOKEN_ROWS rows at a time."""
    if x.shape[0] <= ONE_TOKEN_ROWS:
        return function(x)
    return torch.cat([function(rows) for rows in x.split(ONE_TOKEN_ROWS)])


def in_parts(function, x: torch.Tensor, parts: StepParts | None) -> torch.Tensor:
    """function (rows [S, D] -> [S, D']) on x [T, D], each part of the step apart (the decoding rows
    as_one_token_steps), so that each part's products round as in its steps alone; on all rows at
    once where the step is not split (parts None)."""
    if parts is None:
        return function(x)
    if not parts.runs:
        return as_one_token_steps(function, x)
    pieces = [(rows, function(x[rows])) for rows, _ in parts.runs]
    if len(parts.decoding):
        pieces.append((parts.decoding, as_one_token_steps(function, x[parts.decoding])))
    out = pieces[0][1].new_empty((x.shape[0], *pieces[0][1].shape[1:]))
    for rows, piece in pieces:
        out[rows] = piece
    return out


class StoreOwner:
    """A model that owns its store and the store's preloader (MoEModel, Seq2SeqModel): closed by
    close() or on leaving a with block."""

    store = None
    preloader = None

    def _hold(self, spec: ModelSpec, experts, store, tokenizer, generation_config: dict | None, name: str) -> None:
        """The parts every model keeps as given; activations and residual stream are float32, and so is
        the KV cache unless the loader sets kv_dtype (load(kv_dtype=...))."""
        self.spec = spec
        self.experts = experts
        self.store = store
        self.tokenizer = tokenizer
        self.generation_config = generation_config or {}
        self.name = name
        self.dtype = torch.float32
        self.kv_dtype = torch.float32

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the store's loader and close its files (a model from a checkpoint holds none), and
        remove the preloader's hooks (it holds the model's router), so the model is freed at once."""
        if self.preloader is not None:
            self.remove_routing_hook(self.preloader.routing_hook)
            self.remove_moe_input_hook(self.preloader.moe_input_hook)
            self.preloader = None
        if self.store is not None:
            self.store.close()

    # ---- observers of the MoE layers ------------------------------------------------------------------
    # A routing hook is called as hook(layer, experts [T, A], weights [T, A], positions [T], segments) once
    # a MoE layer's routing is known (traces, profiles, preloading, speculative verification); a MoE-input
    # hook as hook(layer, hidden [T, D]) just before the layer routes (look-ahead preloading, a draft's
    # prefetch). Observers register here; the model calls them in the order registered.
    def add_routing_hook(self, hook) -> None:
        self.routing_hooks.append(hook)

    def remove_routing_hook(self, hook) -> None:
        """Remove `hook` if it is registered."""
        if hook in self.routing_hooks:
            self.routing_hooks.remove(hook)

    def add_moe_input_hook(self, hook) -> None:
        self.moe_input_hooks.append(hook)

    def remove_moe_input_hook(self, hook) -> None:
        """Remove `hook` if it is registered."""
        if hook in self.moe_input_hooks:
            self.moe_input_hooks.remove(hook)

    def _start_preloader(self, store, preload: str) -> None:
        """The store's preloader (none without a store), given this model's router and fed its hooks."""
        if store is None:
            return
        self.preloader = Preloader(self.spec, self.route, store, preload, store.routing_profile)
        if self.preloader.routing_hook is not None:
            self.add_routing_hook(self.preloader.routing_hook)
        if self.preloader.moe_input_hook is not None:
            self.add_moe_input_hook(self.preloader.moe_input_hook)

    # ---- generation (see generate.py) ---------------------------------------------------------------
    def generate(self, prompt, **options) -> str:
        """Text continuing `prompt` (a string, or token ids). Options: edgemoe.generate.generate's."""
        from .generate import generate
        return generate(self, prompt, **options)


class MoEModel(StoreOwner):
    dense_bits: int | None = None   # the dense projections' width once quantized (quantize_dense)

    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], experts: ExpertProvider,
                 tokenizer=None, generation_config: dict | None = None, name: str = "",
                 threads: int | None = None, store=None, preload: str = "none"):
        """store: the TieredStore the experts come from, owned by the model from now on (close());
        preload: its predictor (edgemoe.scheduling.preload.PREDICTORS), "none" without a store."""
        self._hold(spec, experts, store, tokenizer, generation_config, name)   # weights keep their own dtypes
        self.embed = dense["embed"]
        self.final_norm = dense["norm"]
        self.final_norm_bias = dense.get("norm_bias")
        self.lm_head = dense["embed"] if spec.tie_word_embeddings else dense["lm_head"]
        self.lm_head_bias = dense.get("lm_head_bias")
        self._qkv = QKV_PROJECTIONS[spec.attention.kind]
        self._attend = ATTEND[spec.attention.kind]
        self.layers = [{key.split(".", 2)[2]: t for key, t in dense.items() if key.startswith(f"layers.{l}.")}
                       for l in range(spec.num_layers)]
        # Observers of each MoE layer's routing: hook(layer, experts [T, A], weights [T, A], positions [T],
        # segments). Used to record traces and profiles and to drive preloading.
        self.routing_hooks: list = []
        # Called with (layer, hidden [T, D]) just before a MoE layer routes (gate look-ahead preloading).
        self.moe_input_hooks: list = []
        # (layer, positions [T]) -> (weights, experts) replacing the routers (edgemoe.replay).
        self.routing_override = None
        self.timings = Timings()
        self.threads = ThreadGovernor(threads)   # None: the cores other processes leave free
        self.context_length = spec.max_position_embeddings   # positions a sequence may occupy
        self._start_preloader(store, preload)
        # One-token steps of one sequence run each layer's attention block in one kernel call
        # (edgemoe/decode.py) where the layers are its kind; None: the generic forward.
        self.decode_engine = DecodeEngine.for_model(spec, self.layers)

    # ---- public API -------------------------------------------------------------------------------
    def quantize_dense(self, bits: int) -> None:
        """Quantize the dense projections and the LM head to `bits` (edgemoe.dense), in place; the
        embedding stays as loaded (a tied LM head gets a quantized copy of it)."""
        self.layers = [quantize_layer(w, bits) for w in self.layers]
        self.lm_head = quantize_matrix(self.lm_head, bits)
        self.dense_bits = bits
        self.decode_engine = DecodeEngine.for_model(self.spec, self.layers)

    def new_cache(self) -> KVCache:
        return KVCache.for_spec(self.spec, self.kv_dtype, limit=self.context_length)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int] | torch.Tensor, cache: KVCache | None = None,
               one_token_at_a_time: bool = False) -> torch.Tensor:
        """float32 logits [T, V] for a 1-D run of tokens, continuing `cache` if given (else a fresh one).
        one_token_at_a_time: each token's logits bit for bit those of feeding the tokens one per step
        (speculative verification: _layers_one_token_at_a_time)."""
        tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if tokens.numel() == 0:
            raise ValueError("logits: token_ids is empty")
        cache = cache if cache is not None else self.new_cache()
        return self.forward(tokens, [Segment(cache, tokens.numel())], one_token_at_a_time=one_token_at_a_time)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], last_only: bool = False,
                one_token_at_a_time: bool = False) -> torch.Tensor:
        """One step for several sequences: tokens [T] -> float32 logits [T, V] (or [len(segments), V]
        for each segment's last token). Advances every segment's cache. one_token_at_a_time (one
        segment): see logits."""
        if sum(s.num_tokens for s in segments) != tokens.numel():
            raise ValueError("forward: segments do not cover the tokens")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.spec.vocab_size):
            raise ValueError(f"forward: token id outside [0, {self.spec.vocab_size})")
        self.threads.step()
        t = self.timings
        start = time.perf_counter()
        positions = torch.cat([torch.arange(s.cache.length, s.cache.length + s.num_tokens) for s in segments])
        if one_token_at_a_time:
            (segment,) = segments
            x = self._layers_one_token_at_a_time(self.embeddings(tokens), positions, segment.cache)
        else:
            x = self.run_layers(self.embeddings(tokens), positions, segments)   # [T, D]
        for s in segments:
            s.cache.advance(s.num_tokens)
        if last_only:   # a row a sequence, each with the bits of that sequence's step alone
            ends = torch.tensor([s.num_tokens for s in segments]).cumsum(0) - 1
            logits = as_one_token_steps(self.head, x[ends])
        elif one_token_at_a_time:
            logits = torch.cat([self.head(row) for row in x.split(1)])
        else:
            logits = in_parts(self.head, x, self._step_parts(segments))
        elapsed = time.perf_counter() - start
        t.steps += 1
        t.tokens += tokens.numel()
        t.total += elapsed
        t.per_step.append((tokens.numel(), elapsed))
        return logits

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, segments: Sequence[Segment], start: int = 0,
                   stop: int | None = None) -> torch.Tensor:
        """Decoder layers start..stop - 1 (default: to the last) on hidden states x [T, D] (the caches
        are not advanced; the budget search runs one layer at a time)."""
        parts = self._step_parts(segments)
        cos, sin = self._rope_tables(positions, parts)
        if start == 0 and stop is None:
            layouts = self._resident_step_layouts(x, segments)
            if layouts is not None:
                return self._resident_step(x, positions, cos, sin, segments, layouts, parts)
        for l in range(start, self.spec.num_layers if stop is None else stop):
            x = self._layer(l, x, positions, cos, sin, segments, parts)
        return x

    def _layers_one_token_at_a_time(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """run_layers for one sequence's step (x [T, D] at positions [T] after `cache`), every layer
        computing each token as that token's one-token step would: on one-row tensors, its rotary table
        and mask its own, its keys and values appended where its step would append them. torch sums a
        product of several rows in another order than a product of one (GEMM against GEMV blocking)
        and vectorizes an elementwise op (silu, exp, rsqrt) over several rows with other lanes than
        over one, so batched tokens differ in the last bits, in float32 and bfloat16 alike; here each
        token gets plain decoding's bits (speculative verification: greedy output exactly plain
        greedy decoding's). Layer after layer, so a layer's experts serve all the tokens while they
        are resident (one read from the store)."""
        rows, start = list(x.split(1)), cache.length
        try:
            for l in range(self.spec.num_layers):
                for i in range(len(rows)):
                    cache.length = start + i      # token i's step: the cache holds the tokens before it
                    position = positions[i:i + 1]
                    rows[i] = self._layer(l, rows[i], position, *self._rope(position), [Segment(cache, 1)],
                                          self._step_parts([Segment(cache, 1)]))
        finally:
            cache.length = start
        return torch.cat(rows)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self.spec.rotary
        return rope_tables(positions, self.spec.rope_dim, rotary.rope_theta, *rotary.frequencies(positions))

    def _step_parts(self, segments: Sequence[Segment]) -> StepParts | None:
        """The step's parts computed apart (StepParts), on a model that has the decode engine; None for
        one run of one sequence (a prompt chunk alone: nothing to split) or a model without it."""
        if self.decode_engine is None:
            return None
        if len(segments) == 1:
            return ONE_TOKEN if segments[0].num_tokens == 1 else None
        return StepParts.of(segments)

    def _rope_tables(self, positions: torch.Tensor, parts: StepParts | None) -> tuple[torch.Tensor, torch.Tensor]:
        """_rope's tables [T, Dk], each part's rows made apart, each decoding row alone: the bits of
        the part's steps alone (torch's cos and sin of several positions may round otherwise than of
        one, or of others)."""
        if parts is None or positions.numel() == 1:
            return self._rope(positions)
        pieces = [(rows, self._rope(positions[rows])) for rows in [rows for rows, _ in parts.runs]
                  + list(parts.decoding.split(1))]   # every row in one piece
        first = pieces[0][1][0]
        cos, sin = (first.new_empty((positions.numel(), first.shape[1])) for _ in range(2))
        for rows, (row_cos, row_sin) in pieces:
            cos[rows], sin[rows] = row_cos, row_sin
        return cos, sin

    def _layer(self, l: int, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               segments: Sequence[Segment], parts: StepParts | None = None) -> torch.Tensor:
        """Decoder layer l on hidden states x [T, D]: attention, then the MLP or MoE block. Split into
        parts (_step_parts), each part as in its steps alone: a decoding row's attention block by the
        decode engine (cos, sin: those of _rope_tables), a longer run's by the generic block on its
        rows; the MLP or MoE block splits alike (_mlp)."""
        t, w = self.timings, self.layers[l]
        t0 = time.perf_counter()
        if parts is None:
            x = x + self._attention(l, w, self._norm(x, w, "attn_norm"), positions, cos, sin, segments)
            h, logits = self._norm(x, w, "mlp_norm"), None
        else:
            x, h, logits = self._attention_in_parts(l, w, x, positions, cos, sin, segments, parts)
            layouts = self._resident_moe(l) if parts is ONE_TOKEN else None
            if layouts is not None:
                t1 = time.perf_counter()
                self._resident_moe_block(l, x, h, logits, layouts, positions, segments)
                t.attention += t1 - t0
                t.experts += time.perf_counter() - t1
                return x
        t1 = time.perf_counter()
        x = x + self._mlp(l, w, h, positions, segments, logits, parts)
        t.attention += t1 - t0
        t.experts += time.perf_counter() - t1
        return x

    def _attention_in_parts(self, l: int, w: dict, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, segments: Sequence[Segment], parts: StepParts
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer l's attention block: each decoding row by the decode engine, one call a token, its keys
        and values written where cache.append would put them; each longer run by the generic block on
        its rows. Returns (x + attention [T, D], MoE input h [T, D], the decoding rows' router logits
        [len(parts.decoding), E], or None where there are none or the layer does not route). A call a
        token, not one batched product: a step of several tokens rounds its attention otherwise, so a
        sequence's tokens would depend on who shares its steps."""
        engine = self.decode_engine
        if parts is ONE_TOKEN:
            return engine.layer(l, x, segments[0].cache.length, cos, sin, segments[0].cache)
        decoded = self._decoding_attention(l, x, cos, sin, segments, parts)
        if not parts.runs:
            return decoded
        x, h = x.clone(), torch.empty_like(x)
        for rows, segment in parts.runs:
            x[rows] = x[rows] + self._attention(l, w, self._norm(x[rows], w, "attn_norm"), positions[rows], cos[rows],
                                                sin[rows], [segment])
            h[rows] = self._norm(x[rows], w, "mlp_norm")
        if decoded is None:
            return x, h, None
        x[parts.decoding], h[parts.decoding] = decoded[:2]
        return x, h, decoded[2]

    def _decoding_attention(self, l: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            segments: Sequence[Segment], parts: StepParts):
        """The decoding rows' attention blocks by the decode engine: (x + attention, h, router logits or
        None) of those rows, or None where there are none. Several of them in one call where the
        engine has it (layer_rows: the layer's matrices read once), else a call a token."""
        rows = parts.decoding
        if not len(rows):
            return None
        engine, caches = self.decode_engine, [s.cache for s in segments if s.num_tokens == 1]
        if len(rows) > 1 and engine.attends_rows():
            return engine.layer_rows(l, x[rows], cos[rows], sin[rows], caches)
        done = [engine.layer(l, x[r:r + 1], cache.length, cos[r:r + 1], sin[r:r + 1], cache)
                for r, cache in zip(rows.tolist(), caches)]
        logits = None if done[0][2] is None else torch.cat([d[2] for d in done])
        return torch.cat([d[0] for d in done]), torch.cat([d[1] for d in done]), logits

    def _resident_step_layouts(self, x: torch.Tensor, segments: Sequence[Segment]):
        """The experts' layouts when the decode engine runs this step's layers from its step_start on in
        one call (DecodeEngine.step: one float32 token of one sequence, every expert of those layers
        resident in RAM, their MoE blocks ones that the engine computes), else None."""
        engine = self.decode_engine
        if (engine is None or x.shape[0] != 1 or len(segments) != 1 or x.dtype != torch.float32
                or not engine.computes_token()):
            return None
        return self.experts.resident_step_layouts(engine.step_start)

    def _resident_step(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       segments: Sequence[Segment], layouts, parts: StepParts) -> torch.Tensor:
        """run_layers: the layers before the engine's step_start (dense ones) one by one, then the rest
        by the decode engine in one call; then, layer by layer, the hooks and the store's counts see
        what _mlp would show them (after the compute: nothing is left to read)."""
        first = self.decode_engine.step_start
        for l in range(first):
            x = self._layer(l, x, positions, cos, sin, segments, parts)
        start = time.perf_counter()
        x = x.clone()   # updated in place
        replayed = None
        if self.routing_override is not None:   # a replayed trace's choice for each layer, given to the kernel
            choices = [self.routing_override(l, positions) for l in range(first, self.spec.num_layers)]
            replayed = (torch.cat([w for w, _ in choices]), torch.cat([e for _, e in choices]))
        hs, weights, experts = self.decode_engine.step(x, segments[0].cache.length, cos, sin, segments[0].cache,
                                                      layouts, replayed)
        self.timings.layers += time.perf_counter() - start
        self._served_resident(first, hs, weights, experts, positions, segments)
        return x

    def _served_resident(self, first_layer: int, hs: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                         positions: torch.Tensor, segments) -> None:
        """After the decode engine computed the MoE blocks of layers first_layer, first_layer + 1, ...
        of one token (their inputs hs [n, D], choices weights and experts [n, A]): the store's counts
        and the hooks' calls _mlp would have made, layer after layer (after the compute: with every
        expert resident nothing is left to read)."""
        self.experts.served_resident(first_layer, [sorted(set(chosen)) for chosen in experts.tolist()])
        moe_input_hooks, routing_hooks = self._hooks_while_resident()
        if moe_input_hooks or routing_hooks:   # each layer's rows as [1, ...] views
            for l, (h, chosen, weight) in enumerate(zip(hs.split(1), experts.split(1), weights.split(1)), first_layer):
                for hook in moe_input_hooks:
                    hook(l, h)
                for hook in routing_hooks:
                    hook(l, chosen, weight, positions, segments)

    def _hooks_while_resident(self) -> tuple[list, list]:
        """The MoE-input and routing hooks a step with every expert resident calls: all but the
        preloader's, which return at once then (there is nothing to predict or read), and whose calls
        with each layer's rows showed in a fine-grained model's step (docs/benchmarks.md, "thirteenth
        part")."""
        preloader = self.preloader
        if preloader is None:
            return self.moe_input_hooks, self.routing_hooks
        return ([hook for hook in self.moe_input_hooks if hook != preloader.moe_input_hook],
                [hook for hook in self.routing_hooks if hook != preloader.routing_hook])

    def _resident_moe(self, l: int):
        """Layer l's expert layouts when the decode engine computes its MoE block (DecodeEngine.moe:
        every expert resident in RAM, a router it computes), else None."""
        if not self.decode_engine.computes_moe(l):
            return None
        return self.experts.resident_layouts(l)

    def _resident_moe_block(self, l: int, x: torch.Tensor, h: torch.Tensor, logits: torch.Tensor,
                            layouts, positions: torch.Tensor, segments) -> None:
        """_mlp's MoE block for one token by the decode engine, x updated in place; then what
        _served_resident says."""
        replayed = self.routing_override(l, positions) if self.routing_override is not None else None
        weights, experts = self.decode_engine.moe(l, x, h, logits, layouts, replayed)
        self._served_resident(l, h, weights, experts, positions, segments)

    def embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> hidden states [T, D] in the activation dtype."""
        return self.embed[tokens].to(self.dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T, D] -> float32 logits [T, V]."""
        if self.spec.norm == "layer":
            x = layer_norm(x, self.final_norm, self.final_norm_bias, self.spec.rms_norm_eps)
        else:
            x = rms_norm(x, self.final_norm, self.spec.rms_norm_eps)
        return linear(x, self.lm_head, self.lm_head_bias).float()

    def dense_weights(self) -> dict[str, torch.Tensor]:
        """The dense weights under their canonical names (to build a twin with other experts)."""
        top = {"embed": self.embed, "norm": self.final_norm, "norm_bias": self.final_norm_bias,
               "lm_head": None if self.spec.tie_word_embeddings else self.lm_head, "lm_head_bias": self.lm_head_bias}
        dense = {name: t for name, t in top.items() if t is not None}
        for l, weights in enumerate(self.layers):
            dense.update({f"layers.{l}.{name}": t for name, t in weights.items()})
        return dense

    def route(self, l: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's router on its MoE input x [T, D] -> (weights [T, A] float32, experts [T, A])."""
        w = self.layers[l]
        return route_by_spec(x, w["router"], w.get("router_bias"), self.spec)

    # ---- layers -----------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
        if self.spec.norm == "layer":
            return layer_norm(x, w[name], w[name + "_bias"], self.spec.rms_norm_eps)
        return rms_norm(x, w[name], self.spec.rms_norm_eps)

    def _attention(self, l: int, w: dict, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        q, k, v = self._qkv(self.spec, w, x, cos, sin)
        window = self.spec.sliding_windows[l]
        outputs, start = [], 0
        for seg in segments:
            end = start + seg.num_tokens
            keys, values = seg.cache.append(l, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1))
            mask = attention_mask(positions[start:end], keys.shape[1], window)
            outputs.append(self._attend(self.spec, w, q[start:end], keys, values, mask))   # [S, H*Dv]
            start = end
        return linear(torch.cat(outputs), w["o"], w.get("o_bias"))

    def _mlp(self, l: int, w: dict, x: torch.Tensor, positions: torch.Tensor, segments,
             router_logits: torch.Tensor | None = None, parts: StepParts | None = None) -> torch.Tensor:
        """Layer l's MLP or MoE block on its input x [T, D]. parts (_step_parts; router_logits: its
        decoding rows'): each part computed as in its steps alone: the decoding rows' router choices by
        the engine's, a longer run's by route() on its rows; each part's experts on the path chosen
        for its own count, one token for a decoding row (ExpertBatches.parts); the decoding rows'
        shared expert by the engine; dense products on each part's rows apart."""
        if not self.spec.moe_layers[l]:
            return in_parts(lambda rows: swiglu(rows, w["mlp.gate"], w["mlp.up"], w["mlp.down"]), x, parts)
        for hook in self.moe_input_hooks:
            hook(l, x)
        if self.routing_override is not None:
            weights, experts = self.routing_override(l, positions)
        elif parts is not None:
            weights, experts = self._route_in_parts(l, w, x, router_logits, parts)
        else:
            weights, experts = self.route(l, x)
        batches = ExpertBatches.from_routing(weights, experts)
        if parts is not None and x.shape[0] > 1:   # (one token: every path is chosen for one already)
            batches = batches.with_parts(parts.part_of_row)
        self.experts.prepare(l, batches)
        for hook in self.routing_hooks:
            hook(l, experts, weights, positions, segments)
        out = self.experts.run(l, x, batches)
        if self.spec.shared_expert_hidden:
            out = self._add_shared_expert(l, w, x, out, parts)
        return out

    def _route_in_parts(self, l: int, w: dict, x: torch.Tensor, logits: torch.Tensor | None, parts: StepParts
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice (weights [T, A] float32, experts [T, A]): the decoding rows' from their
        logits [len(parts.decoding), E] by the engine's router, each run's by route() on its rows."""
        if not parts.runs:
            return self.decode_engine.choose(logits, w.get("router_bias"))
        chosen = [(rows, self.route(l, x[rows])) for rows, _ in parts.runs]
        if len(parts.decoding):
            chosen.append((parts.decoding, self.decode_engine.choose(logits, w.get("router_bias"))))
        weights = torch.empty(x.shape[0], self.spec.top_k, dtype=torch.float32)
        experts = torch.empty(x.shape[0], self.spec.top_k, dtype=torch.long)
        for rows, (row_weights, row_experts) in chosen:
            weights[rows], experts[rows] = row_weights, row_experts
        return weights, experts

    def _add_shared_expert(self, l: int, w: dict, x: torch.Tensor, out: torch.Tensor,
                           parts: StepParts | None) -> torch.Tensor:
        """out + layer l's shared expert on x [T, D] (gated where the model gates it): the decoding rows
        by the engine where it computes it (the bits of moe()), the rest by the generic block, each
        part apart."""
        if parts is None or not len(parts.decoding) or not self.decode_engine.computes_shared(l):
            return out + in_parts(lambda rows: self._shared_expert(w, rows), x, parts)
        out = out.float().contiguous()
        if not parts.runs:
            self.decode_engine.add_shared(l, x, out)
            return out
        rows = out[parts.decoding]
        self.decode_engine.add_shared(l, x[parts.decoding], rows)
        out[parts.decoding] = rows
        for rows, _ in parts.runs:
            out[rows] += self._shared_expert(w, x[rows])
        return out

    def _shared_expert(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        shared = swiglu(x, w["shared.gate"], w["shared.up"], w["shared.down"])
        if self.spec.shared_expert_gated:
            shared = torch.sigmoid(linear(x, w["shared_gate"])) * shared
        return shared

    # ---- the generation loop's entry points (generate.py) -----------------------------------------
    def open_sequence(self, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> tuple[KVCache, list[int]]:
        """A new sequence's decoding state (an empty KV cache) and the tokens it feeds first: the prompt,
        and the output already chosen where a suspended sequence opens again."""
        return self.new_cache(), [*prompt_ids, *output_ids]

    def next_logits(self, runs: Sequence[Sequence[int]], caches: Sequence[KVCache]) -> torch.Tensor:
        """One forward step: each cache continued by its run of tokens; the float32 logits [len(runs), V]
        of each run's last token."""
        tokens = torch.tensor([t for run in runs for t in run])
        return self.forward(tokens, [Segment(cache, len(run)) for run, cache in zip(runs, caches)], last_only=True)
