"""The statistics of a routing trace that decide what caching and preloading can gain, so that a
generated trace (tools/make_routing_trace.py) and a recorded one can be compared:

    stay             P(an expert a layer used at one token is used by that layer at the next token),
                     over consecutive positions of a sequence (uniform routing: A / E)
    entropy          per layer, the entropy of the experts' shares of routed slots / log(E),
                     averaged over layers (1 = flat popularity)
    top_share        per layer, the most used expert's share of the slots, averaged over layers
                     (uniform: 1 / E)
    predictability   in-sample: for each layer l > first, a table keyed by the experts chosen at
                     l-1 predicts the A most frequent experts at l; the share of layer l's experts
                     it gets right, averaged over tokens and layers
    second_weight_median, second_weight_below_0_2
                     the second expert's weight normalised over the top-k (top-k >= 2 only)

Shapes: E experts, A chosen per token and layer.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

from .profile import TraceRecord


@dataclass
class RoutingStats:
    tokens: int
    layers: int
    experts: int
    top_k: int
    stay: float
    entropy: float
    top_share: float
    predictability: float
    second_weight_median: float | None
    second_weight_below_0_2: float | None

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        uniform_stay = self.top_k / self.experts
        text = [f"{self.tokens} tokens, {self.layers} MoE layers, {self.experts} experts, top-{self.top_k}",
                f"stay probability {self.stay:.3f} (uniform {uniform_stay:.3f})",
                f"popularity: normalized entropy {self.entropy:.3f}, top expert's share {self.top_share:.3f} "
                f"(uniform {1 / self.experts:.3f})",
                f"next-layer pair table, in-sample: {self.predictability:.3f} of the experts predicted"]
        if self.second_weight_median is not None:
            text.append(f"second expert's normalized weight: median {self.second_weight_median:.3f}, "
                        f"{self.second_weight_below_0_2:.3f} below 0.2")
        return text


def routing_statistics(records: list[TraceRecord]) -> RoutingStats:
    if not records:
        raise ValueError("routing statistics: the trace is empty")
    tokens: dict[tuple, dict[int, TraceRecord]] = defaultdict(dict)
    for r in records:
        tokens[(r.seq, r.token)][r.layer] = r
    layers = sorted({r.layer for r in records})
    experts = max(max(r.experts) for r in records) + 1
    top_k = max(len(r.experts) for r in records)
    entropy, top_share = _popularity(records, layers, experts)
    seconds = [r.weights[1] / (r.weights[0] + r.weights[1]) for r in records
               if len(r.weights) >= 2 and r.weights[0] + r.weights[1] > 0]
    return RoutingStats(
        tokens=len(tokens), layers=len(layers), experts=experts, top_k=top_k,
        stay=_stay(tokens), entropy=entropy, top_share=top_share,
        predictability=_predictability(tokens, layers, top_k),
        second_weight_median=statistics.median(seconds) if seconds else None,
        second_weight_below_0_2=sum(w < 0.2 for w in seconds) / len(seconds) if seconds else None)


def _popularity(records, layers, experts) -> tuple[float, float]:
    counts = {l: Counter() for l in layers}
    for r in records:
        counts[r.layer].update(r.experts)
    entropies, shares = [], []
    for l in layers:
        total = sum(counts[l].values())
        p = [c / total for c in counts[l].values()]
        entropies.append(-sum(x * math.log(x) for x in p if x > 0) / math.log(experts) if experts > 1 else 1.0)
        shares.append(max(p))
    return statistics.fmean(entropies), statistics.fmean(shares)


def _stay(tokens) -> float:
    kept = used = 0
    for (seq, position), routing in tokens.items():
        following = tokens.get((seq, position + 1))
        if following is None:
            continue
        for layer, r in routing.items():
            if layer in following:
                kept += len(set(r.experts) & set(following[layer].experts))
                used += len(r.experts)
    return kept / used if used else float("nan")


def _predictability(tokens, layers, top_k) -> float:
    tables: dict[tuple, Counter] = defaultdict(Counter)
    pairs = []
    for routing in tokens.values():
        for before, layer in zip(layers, layers[1:]):
            if before in routing and layer in routing:
                key = (layer, tuple(sorted(routing[before].experts)))
                tables[key].update(routing[layer].experts)
                pairs.append((key, routing[layer].experts))
    if not pairs:
        return float("nan")
    predicted = {key: {e for e, _ in counts.most_common(top_k)} for key, counts in tables.items()}
    right = sum(len(predicted[key] & set(chosen)) for key, chosen in pairs)
    return right / sum(len(chosen) for _, chosen in pairs)
