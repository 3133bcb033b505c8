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
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Callable, Protocol

import numpy as np
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


# The function of each expert kind other than SwiGLU (spec.expert_kind, declared by its model file).
ACTIVATIONS = {"gpt_oss": gpt_oss_expert, "relu": relu_expert}


def expert_activations(spec: ModelSpec, dense: dict[str, torch.Tensor]) -> Callable[[int, int], Activation]:
    """(layer, expert) -> that expert's Activation: its kind's function with the arguments the kind
    gives (its biases, taken from the model's dense weights, and its parameters); None for every expert
    of a SwiGLU model."""
    if spec.expert_activation == "swiglu":
        return lambda layer, expert: None
    function = ACTIVATIONS[spec.expert_activation]
    return lambda layer, expert: partial(function, **spec.expert_kind.arguments(dense, layer, expert))


def layer_kernel_kind(activation: Activation) -> str:
    """How the layer kernel (edgemoe.kernels.ops.swiglu_experts_int) computes an expert of this
    Activation: "rows" (SwiGLU, or Switch's ungated relu: the store's layout row as it is, whose kind
    column says which), "gpt_oss" (the row with the expert's biases: layer_kernel_arguments), or
    "none" (another kind: the per-matrix kernels)."""
    if activation is None or (isinstance(activation, partial) and activation.func is relu_expert):
        return "rows"
    return "gpt_oss" if layer_kernel_arguments(activation) is not None else "none"


def layer_kernel_arguments(activation: Activation) -> dict | None:
    """The arguments (biases, alpha, limit) of a GPT-OSS expert's Activation (expert_activations), the
    one kind besides SwiGLU that the layer kernel computes (edgemoe.kernels.ops.gpt_oss_layout); None
    for any other kind."""
    if isinstance(activation, partial) and activation.func is gpt_oss_expert:
        return activation.keywords
    return None


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
    """One layer's routing, grouped by expert: every (token, expert) pair, sorted by expert (token
    order kept within one), and where each expert's pairs start."""

    experts: list[int]            # active experts, ascending
    pair_tokens: torch.Tensor     # [P] int64: the token index of each pair
    pair_weights: torch.Tensor    # [P] float32: its routing weight
    starts: np.ndarray = field(repr=False, compare=False)   # int64 [A + 1]: expert i's pairs are starts[i]:starts[i + 1]
    # int64 [P]: the part of the step each pair's token is in (model.StepParts): 0, a decoding token,
    # to be computed on the path one token takes; i > 0, a run's, on the path chosen for that run's own
    # count. StoreExperts then computes each part as in its steps alone. None: one part, unsplit.
    parts: np.ndarray | None = field(default=None, repr=False, compare=False)

    def with_parts(self, part_of_token: np.ndarray) -> "ExpertBatches":
        """These batches with each pair's part marked (part_of_token: int64 [T], each token's)."""
        return replace(self, parts=part_of_token[self.pair_tokens.numpy()])

    def path_groups(self, i: int) -> list[tuple[np.ndarray, int]]:
        """Active expert i's pairs in the groups a path is chosen for: (pair indices, the token count
        the path is chosen by), one group a part: its decoding pairs chosen as one token, a run's by
        their count. Unmarked, all its pairs by their count."""
        pairs = np.arange(self.starts[i], self.starts[i + 1])
        if self.parts is None:
            return [(pairs, len(pairs))]
        of_pair = self.parts[pairs]
        if not of_pair.any():   # decoding tokens only (a step of decoding sequences)
            return [(pairs, 1)]
        groups = [pairs[of_pair == part] for part in np.unique(of_pair).tolist()]
        return [(group, 1 if self.parts[group[0]] == 0 else len(group)) for group in groups]

    def path_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """path_groups for every active expert at once: (the expert index [G], the token count its path
        is chosen by [G]) of each group."""
        counts = np.diff(self.starts)
        if self.parts is None:
            return np.arange(len(counts)), counts
        if not self.parts.any():   # decoding tokens only
            return np.arange(len(counts)), np.ones(len(counts), np.int64)
        expert_of_pair = np.repeat(np.arange(len(counts)), counts)
        parts = int(self.parts.max()) + 1
        groups, sizes = np.unique(expert_of_pair * parts + self.parts, return_counts=True)
        return groups // parts, np.where(groups % parts == 0, 1, sizes)

    @classmethod
    def from_lists(cls, experts: list[int], tokens: list[torch.Tensor], weights: list[torch.Tensor]) -> "ExpertBatches":
        """From each active expert's token indices [S] and routing weights [S]."""
        starts = np.cumsum([0] + [len(t) for t in tokens], dtype=np.int64)
        empty = torch.zeros(0)
        return cls(list(experts), torch.cat(tokens) if tokens else empty.long(),
                   torch.cat(weights) if weights else empty, starts)

    @cached_property
    def tokens(self) -> list[torch.Tensor]:
        """Per active expert: indices into the step's tokens [S]."""
        return list(self.pair_tokens.split(np.diff(self.starts).tolist()))

    @cached_property
    def weights(self) -> list[torch.Tensor]:
        """Per active expert: routing weights [S], float32."""
        return list(self.pair_weights.split(np.diff(self.starts).tolist()))

    @classmethod
    def from_routing(cls, weights: torch.Tensor, experts: torch.Tensor) -> "ExpertBatches":
        """weights, experts [T, A] -> batches sorted by expert (stable: token order kept within one)."""
        if experts.shape[0] == 1:
            one = cls._one_token(weights[0], experts[0])
            if one is not None:
                return one
        return cls._sorted(weights, experts)

    @classmethod
    def _sorted(cls, weights: torch.Tensor, experts: torch.Tensor) -> "ExpertBatches":
        """Any step's routing: the (token, expert) pairs sorted by expert, then split by count."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)                       # [T*A]
        order = torch.argsort(flat, stable=True)         # pair indices sorted by expert
        counts = torch.bincount(flat, minlength=1).numpy()
        token_of = order // top_k                        # [T*A] token index of each sorted pair
        weight_of = weights.reshape(-1)[order]
        active = np.flatnonzero(counts)
        return cls(active.tolist(), token_of, weight_of, np.concatenate(([0], np.cumsum(counts[active]))))

    @classmethod
    def _one_token(cls, weights: torch.Tensor, experts: torch.Tensor) -> "ExpertBatches | None":
        """A decode step's routing, weights, experts [A]: no sort or count over tokens, numpy on
        the A ids (torch's per-op overhead is most of a small layer's routing time). None if an
        expert is chosen twice (a replayed trace may do it): the general path then."""
        chosen = experts.numpy()
        order = np.argsort(chosen, kind="stable")
        ids = chosen[order]
        if (ids[1:] == ids[:-1]).any():
            return None
        sorted_weights = torch.from_numpy(np.ascontiguousarray(weights.numpy()[order], np.float32))   # [A]
        return cls(ids.tolist(), torch.zeros(len(ids), dtype=torch.long), sorted_weights,
                   np.arange(len(ids) + 1, dtype=np.int64))   # one pair each

    def __iter__(self):
        return iter(zip(self.experts, self.tokens, self.weights))


class ExpertProvider(ABC):
    """Owns a model's experts; the MoE block asks it to run one layer's batches."""

    @abstractmethod
    def expert(self, layer: int, expert: int) -> Expert: ...

    def prepare(self, layer: int, batches: "ExpertBatches") -> None:
        """The layer's routing is known (called before routing hooks, e.g. preloaders, run)."""

    def resident_layouts(self, layer: int) -> np.ndarray | None:
        """The layer's experts as a layout table the decode engine computes inside its kernel
        (edgemoe.quantized.StoreExperts), or None: the MoE block then runs through run()."""
        return None

    def resident_step_layouts(self, first: int = 0) -> np.ndarray | None:
        """The resident_layouts of layers first..L-1 stacked (int64 [L - first, E, LAYOUT_COLUMNS]), when
        each of them has them: the decode engine then runs those layers in one call. None here."""
        return None

    def served_resident(self, first_layer: int, chosen: list[list[int]]) -> None:
        """Counts the experts the decode engine computed from resident_layouts: chosen[i] (ascending,
        each once) by layer first_layer + i, as run() would have counted them."""

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
