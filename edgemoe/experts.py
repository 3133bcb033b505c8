"""The one expert abstraction the MoE block computes through.

An Expert maps the tokens routed to it, x [S, D], to its output [S, D]. ExpertBatches is one MoE
layer's routing re-batched by expert: token-expert pairs sorted by expert, one contiguous batch per
active expert, so each expert is fetched and computed once per step whatever the number of tokens,
sequences or beams. An ExpertProvider owns the experts (in memory now; quantized and tiered behind
the same interface) and runs a layer's batches.

Shapes: T tokens, D hidden, I expert hidden, E experts, A active experts per token, S tokens of one expert.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Protocol

import torch

from .kernels.activations import Matmul, gpt_oss_expert, relu_expert
from .layers import linear, swiglu
from .spec import ModelSpec

# A non-SwiGLU expert's computation with its biases and parameters bound: (x [S, D], matmul) -> [S, D]
# (edgemoe/kernels/activations.py). None stands for SwiGLU, which the fused kernels compute.
Activation = Callable[[torch.Tensor, Matmul], torch.Tensor] | None


class Expert(Protocol):
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def expert_activations(spec: ModelSpec, dense: dict[str, torch.Tensor]) -> Callable[[int, int], Activation]:
    """(layer, expert) -> that expert's Activation, its biases taken from the model's dense weights
    (canonical names, edgemoe/spec.py); None for every expert of a SwiGLU model."""
    if spec.expert_activation == "gpt_oss":
        def bound(layer: int, expert: int) -> Activation:
            gate_up = dense[f"layers.{layer}.expert_gate_up_bias"][expert].float()    # [2I], interleaved
            return partial(gpt_oss_expert, gate_bias=gate_up[0::2], up_bias=gate_up[1::2],
                           down_bias=dense[f"layers.{layer}.expert_down_bias"][expert].float(),
                           alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
        return bound
    if spec.expert_activation == "relu":
        return lambda layer, expert: relu_expert
    return lambda layer, expert: None


def dense_matmul(weights: dict[str, torch.Tensor]) -> Matmul:
    """An Activation's matmul over full-precision weights (role -> [R, C], on the input's device)."""
    return lambda h, role: linear(h, weights[role])


class DenseExpert:
    """An expert with full-precision weights: up [I, D], down [D, I] and, unless ungated, gate [I, D];
    SwiGLU unless given another Activation (an ungated kind always has one)."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None = None,
                 activation: Activation = None):
        if gate is None and activation is None:
            raise ValueError("DenseExpert: a SwiGLU expert needs its gate matrix")
        self.weights = {role: t for role, t in (("gate", gate), ("up", up), ("down", down)) if t is not None}
        self.activation = activation
        self.nbytes = sum(t.numel() * t.element_size() for t in self.weights.values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation is None:
            w = self.weights
            return swiglu(x, w["gate"], w["up"], w["down"])
        return self.activation(x.float(), dense_matmul(self.weights)).to(x.dtype)


@dataclass(frozen=True)
class ExpertBatches:
    """One layer's routing, grouped by expert."""

    experts: list[int]            # active experts, ascending
    tokens: list[torch.Tensor]    # per active expert: indices into the step's tokens [S]
    weights: list[torch.Tensor]   # per active expert: routing weights [S], float32
    # The same, every (token, expert) pair in order [P] (made from the lists when not given).
    pair_tokens: torch.Tensor | None = field(default=None, repr=False, compare=False)
    pair_weights: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token index, routing weight) of every pair, expert after expert: [P], [P]."""
        if self.pair_tokens is None:
            return torch.cat(self.tokens), torch.cat(self.weights)
        return self.pair_tokens, self.pair_weights

    @classmethod
    def from_routing(cls, weights: torch.Tensor, experts: torch.Tensor) -> "ExpertBatches":
        """weights, experts [T, A] -> batches sorted by expert (stable: token order kept within one)."""
        if experts.shape[0] == 1 and len(set(experts[0].tolist())) == experts.shape[1]:
            return cls._one_token(weights[0], experts[0])
        return cls._sorted(weights, experts)

    @classmethod
    def _sorted(cls, weights: torch.Tensor, experts: torch.Tensor) -> "ExpertBatches":
        """Any step's routing: the (token, expert) pairs sorted by expert, then split by count."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)                       # [T*A]
        order = torch.argsort(flat, stable=True)         # pair indices sorted by expert
        counts = torch.bincount(flat, minlength=1).tolist()
        token_of = order // top_k                        # [T*A] token index of each sorted pair
        weight_of = weights.reshape(-1)[order]
        active, tokens, ws, start = [], [], [], 0
        for e, n in enumerate(counts):
            if n:
                active.append(e)
                tokens.append(token_of[start:start + n])
                ws.append(weight_of[start:start + n])
                start += n
        return cls(active, tokens, ws, token_of, weight_of)

    @classmethod
    def _one_token(cls, weights: torch.Tensor, experts: torch.Tensor) -> "ExpertBatches":
        """A decode step's routing, weights, experts [A] (distinct): no sort or count over tokens."""
        chosen = experts.tolist()
        order = sorted(range(len(chosen)), key=chosen.__getitem__)
        token = torch.zeros(1, dtype=torch.long)
        sorted_weights = weights[torch.tensor(order)]                      # [A]
        return cls([chosen[i] for i in order], [token] * len(order), list(sorted_weights.split(1)),
                   torch.zeros(len(order), dtype=torch.long), sorted_weights)

    def __iter__(self):
        return iter(zip(self.experts, self.tokens, self.weights))


class ExpertProvider(ABC):
    """Owns a model's experts; the MoE block asks it to run one layer's batches."""

    @abstractmethod
    def expert(self, layer: int, expert: int) -> Expert: ...

    def prepare(self, layer: int, batches: "ExpertBatches") -> None:
        """The layer's routing is known (called before routing hooks, e.g. preloaders, run)."""

    def run(self, layer: int, x: torch.Tensor, batches: ExpertBatches) -> torch.Tensor:
        """Weighted sum of the active experts' outputs per token: x [T, D] -> [T, D]."""
        out = torch.zeros_like(x)
        for e, tokens, weights in batches:
            y = self.expert(layer, e)(x[tokens])                  # [S, D]
            # A token appears once per expert, so this scatter has no collisions; index_put_ with
            # accumulate is ~100x faster than index_add_ on CPU for S in the tens (measured).
            out.index_put_((tokens,), y * weights[:, None].to(y.dtype), accumulate=True)
        return out


class WeightSource(Protocol):
    """A provider that can give an expert's full weights: what a re-quantized copy is made from (a
    speculative self-draft's LowWidthExperts). InMemoryExperts and StoreExperts are ones."""

    def float_weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The expert's matrices in float32: gate (unless ungated), up [I, D], down [D, I]."""

    def activation(self, layer: int, expert: int) -> Activation:
        """The expert's kind with its biases bound (None: SwiGLU)."""


class InMemoryExperts(ExpertProvider):
    """Every expert resident as a DenseExpert (a plain checkpoint loaded into RAM)."""

    def __init__(self, experts: dict[tuple[int, int], Expert]):
        self.experts = experts

    def expert(self, layer: int, expert: int) -> Expert:
        return self.experts[layer, expert]

    def float_weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return {role: w.float() for role, w in self.experts[layer, expert].weights.items()}

    def activation(self, layer: int, expert: int) -> Activation:
        return self.experts[layer, expert].activation

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts.values())
