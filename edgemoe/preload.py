"""Preloading: predict the experts of the next MoE layer and hand them to the store's loader.

Predictors:
- "correlation" (EdgeMoE): the store's routing profile, P(expert at l | experts at l-1 and l-2)
  with back-off (edgemoe.store.profile); issued as soon as layer l-1's routing is known.
- "lookahead" (Mixtral-offloading): the next MoE layer's router applied to this layer's MoE input;
  issued just before this layer routes.
For a step with several tokens the predicted probabilities are summed over tokens.

How many experts to preload (SP-MoE's cutoff): as many as can be read while the model computes
until the predicted layer runs: floor(layer time / read time per expert), both measured while
running (moving averages of the time between consecutive MoE layers and of the disk tier's reads),
at least 1 and at most top-k per token. When a layer's real routing is known, preloads still queued
for it are dropped, so the loader never delays a read the compute needs.

Shapes: T tokens in the step, D hidden, A experts per token, E experts.
"""

from __future__ import annotations

import time

import torch

from .layers import route

PREDICTORS = ("auto", "correlation", "lookahead", "none")


class Preloader:
    def __init__(self, model, store, predictor: str = "auto", profile=None, smoothing: float = 0.2):
        if predictor not in PREDICTORS:
            raise ValueError(f"preload={predictor!r}: expected one of {PREDICTORS}")
        if predictor == "auto":
            predictor = "correlation" if profile is not None else "lookahead"
        if predictor == "correlation" and profile is None:
            raise ValueError(f"preload='correlation': {store.path} has no routing profile (run edgemoe profile)")
        self.model, self.store, self.predictor, self.profile = model, store, predictor, profile
        moe = model.spec.moe_layer_ids
        self.next_moe = {l: moe[i + 1] for i, l in enumerate(moe[:-1])}
        self.first_moe = moe[0]
        self.smoothing = smoothing
        self.layer_seconds: float | None = None
        self._last_event: float | None = None
        self._history: list[dict[int, tuple[int, ...]]] = []
        self._predicted: dict[int, set[int]] = {}
        self.predicted = self.correct = self.actual = 0

    # ---- hooks ------------------------------------------------------------------------------------
    def attach(self) -> "Preloader":
        if self.predictor != "none":
            self.model.routing_hooks.append(self.on_routing)
            if self.predictor == "lookahead":
                self.model.moe_input_hooks.append(self.on_moe_input)
        return self

    def on_moe_input(self, layer: int, hidden: torch.Tensor) -> None:
        nxt = self.next_moe.get(layer)
        if nxt is None:
            return
        spec = self.model.spec
        weights, experts = route(hidden, self.model.layers[nxt]["router"], spec.top_k, spec.norm_topk_prob)
        scores = torch.zeros(spec.num_experts).index_add_(0, experts.reshape(-1), weights.reshape(-1).float())
        self._issue(nxt, scores, hidden.shape[0])

    def on_routing(self, layer, experts, weights, positions, segments) -> None:
        self._time_layer()
        self.store.cancel_preloads(layer)
        chosen = [tuple(row) for row in experts.tolist()]
        self._score(layer, chosen)
        if layer == self.first_moe or len(self._history) != len(chosen):
            self._history = [{} for _ in chosen]
        for history, token_experts in zip(self._history, chosen):
            history[layer] = token_experts
        nxt = self.next_moe.get(layer)
        if nxt is not None and self.predictor == "correlation":
            scores = torch.zeros(self.model.spec.num_experts)
            for history in self._history:
                for e, p in self.profile.predict(nxt, history):
                    scores[e] += p
            self._issue(nxt, scores, len(chosen))

    # ---- internals --------------------------------------------------------------------------------
    def _time_layer(self) -> None:
        now = time.perf_counter()
        if self._last_event is not None:
            gap = now - self._last_event
            if gap < 1.0:  # a gap between steps (sampling, the user) is not a layer's compute
                a = self.smoothing
                self.layer_seconds = gap if self.layer_seconds is None else (1 - a) * self.layer_seconds + a * gap
        self._last_event = now

    def budget(self, tokens: int) -> int:
        """Experts worth preloading for the next layer: what fits under one layer's compute."""
        most = min(self.model.spec.num_experts, self.model.spec.top_k * tokens)
        disk = self.store.disk
        if self.layer_seconds is None or disk.reads == 0:
            return most
        per_read = disk.read_seconds / disk.reads
        return max(1, min(most, int(self.layer_seconds / per_read)))

    def _issue(self, layer: int, scores: torch.Tensor, tokens: int) -> None:
        ranked = torch.argsort(scores, descending=True, stable=True)[:self.budget(tokens)].tolist()
        ranked = [e for e in ranked if scores[e] > 0]
        self._predicted[layer] = set(ranked)
        self.store.prefetch((layer, e) for e in ranked)

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
