"""Preloading: predict the experts of the next MoE layer and hand them to the store's loader.

Predictors ("auto": the one the store's profiling measured better, auto_predictor):
- "correlation" (EdgeMoE): the store's routing profile, P(expert at l | experts at l-1 and l-2)
  with back-off (edgemoe.scheduling.profile); issued as soon as layer l-1's routing is known.
- "lookahead" (Mixtral-offloading): the next MoE layer's router applied to this layer's MoE input;
  issued just before this layer routes.
Both predict within a stack: an encoder-decoder's encoder tokens predict nothing of its decoder's
first MoE layer.
For a step with several tokens, an expert's score is the probability that any token needs it,
1 - prod_t (1 - p_t) (correlation), or the sum of the routers' weights (lookahead).

What to preload: the best-scored experts not already resident; with correlation only those more
likely than not to be needed (p >= 0.5: the profile's probabilities are calibrated, and a preload
is a disk read and a cache slot, so a wrong one costs a read and evicts an expert that may be hit).
The lookahead's choices are the next router's own top-k on a nearby input: all are taken, as
certain (p = 1; router weights are not probabilities). Then the store's eviction policy admits
them or not (TieredStore.admit, the rule edgemoe/scheduling/simulate.py replays): "expected-use" skips a
preload unlikely enough that its read would add more than it converts, given the expert it would
evict (edgemoe/scheduling/policies.py); the other policies admit every one.

How many (SP-MoE's cutoff, counted in the disk's idle time): each layer earns credit for the
reads that fit in the time the disk was idle since the previous layer (time between consecutive
MoE layers minus the disk tier's read time in it; moving averages), and each preload spends one.
The credit is capped at top-k per token. When the compute waits for reads (disk-bound), the
disk is never idle and nothing is preloaded: every preload would delay a read the compute needs.
Before anything is measured, top-k reads per token are affordable. When none is, or the guard has
turned preloading off, nothing is predicted at all: a prediction costs the compute thread's time
(the profile's look-ups, the next router). When a layer's real routing is
known, preloads still queued for it are dropped; the store starts a preload only once the running
layer has the experts it waits for (edgemoe/store/loads.py).

Shapes: T tokens in the step, D hidden, A experts per token, E experts.
"""

from __future__ import annotations

import time

import torch

from edgemoe.options import OptionError


PREDICTORS = ("auto", "correlation", "lookahead", "none")
MIN_PROBABILITY = 0.5


def auto_predictor(profile, recorded: str | None) -> str:
    """preload="auto": the predictor the store's profiling measured better (recorded in profile.json,
    edgemoe.scheduling.predictor_choice), else correlation if the store has a routing profile (one
    profiled before the measurement existed), else lookahead."""
    if recorded is not None and (recorded == "lookahead" or profile is not None):
        return recorded
    return "correlation" if profile is not None else "lookahead"


def stack_starts(spec) -> set[int]:
    """The first MoE layer of each stack (an encoder-decoder has two): its tokens' history starts
    there, as in the routing profile (edgemoe.tracing), and no predictor predicts across: the
    encoder's tokens are not the decoder's."""
    moe = spec.moe_layer_ids
    firsts = (0, spec.stacks.encoder_layers) if spec.is_encoder_decoder else (0,)
    return {min(l for l in moe if l >= first) for first in firsts if moe[-1] >= first}


def next_moe_layers(spec) -> dict[int, int]:
    """MoE layer -> the MoE layer after it in the same stack: what a predictor at that layer predicts."""
    moe, starts = spec.moe_layer_ids, stack_starts(spec)
    return {l: nxt for l, nxt in zip(moe, moe[1:]) if nxt not in starts}


class Preloader:
    """Predicts a model's next MoE layer for its store. The model gives its spec and its router
    (route(layer, hidden) -> (weights, experts)) and registers the preloader's hooks, routing_hook
    and, for the look-ahead, moe_input_hook (None where the predictor needs none)."""

    def __init__(self, spec, route, store, predictor: str = "auto", profile=None, smoothing: float = 0.2):
        if predictor == "auto":
            predictor = auto_predictor(profile, store.predictor_choice)
        if predictor == "correlation" and profile is None:
            raise OptionError("preload=", predictor, f"{store.path} has no routing profile (run edgemoe profile)")
        self.spec, self.route, self.store, self.predictor, self.profile = spec, route, store, predictor, profile
        self.stack_starts = stack_starts(spec)
        self.next_moe = next_moe_layers(spec)
        self.smoothing = smoothing
        self.layer_seconds: float | None = None   # between consecutive MoE layers (moving average)
        self.idle_seconds: float | None = None    # of it, the disk's idle time (moving average)
        self.credit = 0.0                         # reads the disk's idle time has paid for
        self._last_event: float | None = None
        self._last_busy = 0.0
        self._history: list[dict[int, tuple[int, ...]]] = []
        self._predicted: dict[int, set[int]] = {}
        self.predicted = self.correct = self.actual = 0

    # ---- hooks ------------------------------------------------------------------------------------
    # Properties, not attributes: a bound method kept on its own object is a reference cycle, which
    # would keep the model (the router's owner) alive after close() until the garbage collector ran.
    @property
    def routing_hook(self):
        return self.on_routing if self.predictor != "none" else None

    @property
    def moe_input_hook(self):
        return self.on_moe_input if self.predictor == "lookahead" else None

    def on_moe_input(self, layer: int, hidden: torch.Tensor) -> None:
        nxt = self.next_moe.get(layer)
        if nxt is None or self.store.holds_everything():
            return
        affordable = self._affordable(hidden.shape[0])
        if not affordable:
            return
        weights, experts = self.route(nxt, hidden)
        scores = torch.zeros(self.spec.num_experts).index_add_(0, experts.reshape(-1), weights.reshape(-1).float())
        self._issue(nxt, scores.tolist(), affordable, least=1e-9, certain=True)

    def on_routing(self, layer, experts, weights, positions, segments) -> None:
        if self.store.holds_everything():   # a model that fits: predicting would only cost time
            return
        self._time_layer()
        self.store.cancel_preloads(layer)
        chosen = [tuple(row) for row in experts.tolist()]
        self._score(layer, chosen)
        if layer in self.stack_starts or len(self._history) != len(chosen):
            self._history = [{} for _ in chosen]
        for history, token_experts in zip(self._history, chosen):
            history[layer] = token_experts
        nxt = self.next_moe.get(layer)
        affordable = self._affordable(len(chosen)) if nxt is not None and self.predictor == "correlation" else 0
        if affordable:
            # P(no token needs e), in Python floats: E scalar torch ops a layer cost a fine-grained
            # model's decode several ms a token (docs/benchmarks.md)
            unneeded = [1.0] * self.spec.num_experts
            for history in self._history:
                for e, p in self.profile.predict(nxt, history):
                    unneeded[e] *= 1 - p
            self._issue(nxt, [1 - u for u in unneeded], affordable, least=MIN_PROBABILITY)

    # ---- internals --------------------------------------------------------------------------------
    def _time_layer(self) -> None:
        now, busy = time.perf_counter(), self.store.disk.read_seconds
        if self._last_event is not None:
            gap = now - self._last_event
            if gap < 1.0:  # a gap between steps (sampling, the user) is not a layer's compute
                # Reads overlapping each other are each counted: the idle time is an underestimate.
                idle = max(0.0, gap - (busy - self._last_busy))
                self.layer_seconds = self._average(self.layer_seconds, gap)
                self.idle_seconds = self._average(self.idle_seconds, idle)
        self._last_event, self._last_busy = now, busy

    def _average(self, mean: float | None, value: float) -> float:
        return value if mean is None else (1 - self.smoothing) * mean + self.smoothing * value

    def affordable_reads(self, tokens: int) -> int:
        """Experts worth preloading for the next layer: the reads the disk's idle time pays for."""
        most = min(self.spec.num_experts, self.spec.top_k * tokens)
        reads = self.store.disk.reads_within(self.idle_seconds)
        if reads is None:
            return most
        self.credit = min(most, self.credit + reads)
        return int(self.credit)

    def _affordable(self, tokens: int) -> int:
        """Preloads that may go for the next layer: none while the guard has turned preloading off
        (then predicting would only take the compute thread's time), else affordable_reads."""
        guard = self.store.guard
        if guard is not None and not guard.allow_preload:
            return 0
        return self.affordable_reads(tokens)

    def _issue(self, layer: int, scores: list[float], affordable: int, least: float, certain: bool = False) -> None:
        """Preload the best-scored experts of `layer` scoring at least `least` that the store admits
        (not resident nor being read, worth their read: TieredStore.admit), at most `affordable`.
        scores (one per expert) are probabilities of use, unless `certain` (then each counts as p = 1);
        equal scores go by expert id."""
        ranked = sorted((e for e, score in enumerate(scores) if score >= least), key=lambda e: -scores[e])
        likely = [((layer, e), 1.0 if certain else scores[e]) for e in ranked]
        chosen = self.store.admit(likely)[:affordable]
        self.credit = max(0.0, self.credit - len(chosen))
        self._predicted[layer] = {e for _, e in chosen}
        self.store.prefetch(chosen)

    def _score(self, layer: int, chosen: list[tuple[int, ...]]) -> None:
        predicted = self._predicted.pop(layer, None)
        if predicted is None:
            return
        actual = {e for token in chosen for e in token}
        self.predicted += len(predicted)
        self.actual += len(actual)
        self.correct += len(predicted & actual)

    @property
    def precision(self) -> float | None:
        return self.correct / self.predicted if self.predicted else None

    @property
    def recall(self) -> float | None:
        return self.correct / self.actual if self.actual else None
