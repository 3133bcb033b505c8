"""The MoE decoder: dense weights always resident, experts behind an ExpertProvider.

A step takes the new tokens of one or more sequences, flattened: tokens [T], with one Segment per
sequence (its KV cache and its run of tokens). Everything but attention works on the flat [T, D]
batch, so the expert path never depends on how many sequences, beams or positions arrive.

Shapes: T tokens in the step, D hidden, V vocab, H heads, K kv heads, Dh head dim, S tokens of one sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .cache import KVCache
from .experts import ExpertBatches, ExpertProvider
from .layers import apply_rope, attend, attention_mask, linear, rms_norm, rope_tables, route, swiglu
from .models.spec import ModelSpec
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
    total: float = 0.0
    steps: int = 0
    tokens: int = 0
    per_step: list = field(default_factory=list)   # (tokens, seconds) of each forward step

    @property
    def other(self) -> float:
        return self.total - self.attention - self.experts

    def reset(self) -> None:
        self.__init__()


class MoEModel:
    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], experts: ExpertProvider,
                 tokenizer=None, generation_config: dict | None = None, name: str = "",
                 threads: int | None = None):
        self.spec = spec
        self.experts = experts
        self.tokenizer = tokenizer
        self.generation_config = generation_config or {}
        self.name = name
        self.dtype = torch.float32   # activations, residual stream, KV cache; weights keep their own
        self.embed = dense["embed"]
        self.final_norm = dense["norm"]
        self.lm_head = dense["embed"] if spec.tie_word_embeddings else dense["lm_head"]
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

    # ---- public API -------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        s = self.spec
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, dtype=self.dtype)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int] | torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """float32 logits [T, V] for a 1-D run of tokens, continuing `cache` if given (else a fresh one)."""
        tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if tokens.numel() == 0:
            raise ValueError("logits: token_ids is empty")
        cache = cache if cache is not None else self.new_cache()
        return self.forward(tokens, [Segment(cache, tokens.numel())])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment], last_only: bool = False) -> torch.Tensor:
        """One step for several sequences: tokens [T] -> float32 logits [T, V] (or [len(segments), V]
        for each segment's last token). Advances every segment's cache."""
        if sum(s.num_tokens for s in segments) != tokens.numel():
            raise ValueError("forward: segments do not cover the tokens")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.spec.vocab_size):
            raise ValueError(f"forward: token id outside [0, {self.spec.vocab_size})")
        self.threads.step()
        t = self.timings
        start = time.perf_counter()
        positions = torch.cat([torch.arange(s.cache.length, s.cache.length + s.num_tokens) for s in segments])
        x = self.run_layers(self.embeddings(tokens), positions, segments)   # [T, D]
        for s in segments:
            s.cache.advance(s.num_tokens)
        if last_only:
            ends = torch.tensor([s.num_tokens for s in segments]).cumsum(0) - 1
            x = x[ends]
        logits = self.head(x)
        elapsed = time.perf_counter() - start
        t.steps += 1
        t.tokens += tokens.numel()
        t.total += elapsed
        t.per_step.append((tokens.numel(), elapsed))
        return logits

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, segments: Sequence[Segment], start: int = 0,
                   on_layer_input=None) -> torch.Tensor:
        """Decoder layers start.. on hidden states x [T, D] (the caches are not advanced).
        on_layer_input(l, x) sees each layer's input (the budget search caches them)."""
        t = self.timings
        cos, sin = rope_tables(positions, self.spec.head_dim, self.spec.rope_theta)
        for l in range(start, self.spec.num_layers):
            if on_layer_input is not None:
                on_layer_input(l, x)
            w = self.layers[l]
            t0 = time.perf_counter()
            x = x + self._attention(l, w, rms_norm(x, w["attn_norm"], self.spec.rms_norm_eps),
                                    positions, cos, sin, segments)
            t1 = time.perf_counter()
            x = x + self._mlp(l, w, rms_norm(x, w["mlp_norm"], self.spec.rms_norm_eps), positions, segments)
            t.attention += t1 - t0
            t.experts += time.perf_counter() - t1
        return x

    def embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> hidden states [T, D] in the activation dtype."""
        return self.embed[tokens].to(self.dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T, D] -> float32 logits [T, V]."""
        return linear(rms_norm(x, self.final_norm, self.spec.rms_norm_eps), self.lm_head).float()

    # ---- layers -----------------------------------------------------------------------------------
    def _qkv(self, w: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        q = linear(x, w["q"], w.get("q_bias"))      # [T, H*Dh]
        k = linear(x, w["k"], w.get("k_bias"))      # [T, K*Dh]
        v = linear(x, w["v"], w.get("v_bias"))
        if s.qk_norm == "proj":
            q, k = rms_norm(q, w["q_norm"], s.rms_norm_eps), rms_norm(k, w["k_norm"], s.rms_norm_eps)
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        T = x.shape[0]
        q = q.view(T, s.num_heads, s.head_dim)
        k = k.view(T, s.num_kv_heads, s.head_dim)
        v = v.view(T, s.num_kv_heads, s.head_dim)
        if s.qk_norm == "head":
            q, k = rms_norm(q, w["q_norm"], s.rms_norm_eps), rms_norm(k, w["k_norm"], s.rms_norm_eps)
        return q, k, v

    def _attention(self, l: int, w: dict, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        q, k, v = self._qkv(w, x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = self.spec.sliding_windows[l]
        outputs, start = [], 0
        for seg in segments:
            end = start + seg.num_tokens
            keys, values = seg.cache.append(l, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1))
            mask = attention_mask(positions[start:end], keys.shape[1], window)
            outputs.append(attend(q[start:end], keys, values, mask))   # [S, H*Dh]
            start = end
        return linear(torch.cat(outputs), w["o"])

    def _mlp(self, l: int, w: dict, x: torch.Tensor, positions: torch.Tensor, segments) -> torch.Tensor:
        if not self.spec.moe_layers[l]:
            return swiglu(x, w["mlp.gate"], w["mlp.up"], w["mlp.down"])
        for hook in self.moe_input_hooks:
            hook(l, x)
        if self.routing_override is not None:
            weights, experts = self.routing_override(l, positions)
        else:
            weights, experts = route(x, w["router"], self.spec.top_k, self.spec.norm_topk_prob)
        batches = ExpertBatches.from_routing(weights, experts)
        self.experts.prepare(l, batches)
        for hook in self.routing_hooks:
            hook(l, experts, weights, positions, segments)
        out = self.experts.run(l, x, batches)
        if self.spec.shared_expert_hidden:
            shared = swiglu(x, w["shared.gate"], w["shared.up"], w["shared.down"])
            out = out + torch.sigmoid(linear(x, w["shared_gate"])) * shared
        return out

    # ---- generation (see generate.py) ---------------------------------------------------------------
    def generate(self, prompt, **options) -> str:
        """Text continuing `prompt` (a string, or token ids). Options: see edgemoe.generate.GenerationOptions."""
        from .generate import generate
        return generate(self, prompt, **options)
