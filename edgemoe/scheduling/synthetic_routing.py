"""Routing traces for any depth and expert count with given statistics (edgemoe/scheduling/routing_stats.py), for
benchmarks and tests of random-weight models that must route like a real one: nothing wraps a
shallow trace over a deeper model, so no layer repeats another's choices.

The default targets are those measured on a real Mixtral-8x7B decode trace (32 layers, 8 experts,
top-2, GSM8K prompts): stay probability 0.34-0.40, the most used expert 18-19% of a layer's slots,
a next-layer pair table right for 45-48% of the experts in-sample, the second expert's normalized
weight with median 0.29-0.32 and 24-31% of them below 0.2. The midpoints are the defaults, kept
relative to uniform routing for other shapes (RoutingTargets): an extrapolation, not a measurement,
for models with more experts. The in-sample predictability falls as a trace grows (fewer tokens per
table key overfit less); the calibration trace has 768 tokens.

Generative model, per sequence, token t and MoE layer l (in order), E experts, top-k A:
    score[e] = log popularity[l][e] + stay_bonus * [e chosen at (t-1, l)]
               + affinity * log follow[l][experts chosen at (t, l-1)][e] + Gumbel noise
    experts = the A highest scores (sampling A without replacement in proportion to exp(score))
popularity[l] is drawn from a Dirichlet, follow[l][key] (the experts a layer tends to pick after a
given choice at the layer before) from a sparser one. The three knobs (Dirichlet concentration,
stay_bonus, affinity) are calibrated on a short trace until its statistics meet the targets.
Weights: the second expert's normalized weight w is 0.5 * sigmoid(N(mu, sigma)), with mu, sigma
solved from the target median and share below 0.2; the first gets 1 - w.

Shapes: S sequences, E experts, A chosen per token and layer.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, replace

import numpy as np

from .profile import TraceRecord
from .routing_stats import RoutingStats, routing_statistics


CALIBRATION_TOKENS = 2**32 - 1   # the token seed of calibration traces
MAX_FOLLOW_KEYS = 4096   # choices at the layer before share follow tables beyond this many


@dataclass(frozen=True)
class RoutingTargets:
    """Targets relative to uniform routing (A / E chosen, 1 / E share), so that one set fits any shape:
    for Mixtral's 8 experts top-2 the defaults are stay 0.37, top share 0.185, predictability 0.465."""

    stay_excess: float = 0.16             # (stay - A/E) / (1 - A/E)
    top_share_ratio: float = 1.48         # top expert's share / (1/E)
    predictability_excess: float = 0.287  # (predictability - A/E) / (1 - A/E)
    second_weight_median: float = 0.305
    second_weight_below_0_2: float = 0.275
    entropy: float | None = None          # normalized popularity entropy; given, it sets the skew instead of top_share_ratio

    def absolute(self, experts: int, top_k: int) -> dict:
        """The statistics these targets ask of a trace with E experts, top-k A."""
        base = top_k / experts
        return {"stay": base + self.stay_excess * (1 - base), "top_share": self.top_share_ratio / experts,
                "predictability": base + self.predictability_excess * (1 - base)}


@dataclass(frozen=True)
class Knobs:
    concentration: float = 20.0   # Dirichlet of popularity: lower = more skewed
    stay_bonus: float = 1.0
    affinity: float = 1.0
    follow_concentration: float = 0.5


def generate(layers: int, experts: int, top_k: int, sequences: int, tokens: int,
             targets: RoutingTargets = RoutingTargets(), seed: int = 0, model_seed: int = 0,
             calibration_rounds: int = 8) -> tuple[list[TraceRecord], RoutingStats]:
    """A trace of `sequences` x `tokens` tokens over MoE layers 0..layers-1, and its statistics.
    model_seed draws the "model" (popularity, follow tables), seed the tokens: two traces of one
    model_seed and other seeds are two texts through the same model (a profile from one predicts
    the other as well as a real model's profile does)."""
    _check(layers, experts, top_k, sequences, tokens, targets)
    knobs = calibrate(layers, experts, top_k, targets, model_seed, calibration_rounds)
    records = _sample(layers, experts, top_k, sequences, tokens, knobs, targets,
                      np.random.default_rng(model_seed), np.random.default_rng([model_seed, seed]))
    return records, routing_statistics(records)


@functools.lru_cache(maxsize=8)
def calibrate(layers: int, experts: int, top_k: int, targets: RoutingTargets, seed: int = 0,
              rounds: int = 8) -> Knobs:
    """Knobs whose short trace meets the targets: each round moves each knob by the gap between its
    statistic and the target (every statistic rises with its knob)."""
    want = targets.absolute(experts, top_k)
    uniform_stay, uniform_share = top_k / experts, 1 / experts
    knobs = Knobs()
    for _ in range(rounds):   # the same draws every round: only the knobs move
        sample = _sample(layers, experts, top_k, 16, 48, knobs, targets, np.random.default_rng(seed),
                         np.random.default_rng([seed, CALIBRATION_TOKENS]))
        got = routing_statistics(sample)
        if targets.entropy is None:
            skew_gap = math.log(got.top_share - uniform_share + 1e-3) - math.log(want["top_share"] - uniform_share + 1e-3)
        else:   # skew as 1 - entropy
            skew_gap = math.log(1 - got.entropy + 1e-4) - math.log(1 - targets.entropy + 1e-4)
        knobs = replace(
            knobs,
            concentration=min(1e4, knobs.concentration * math.exp(2.0 * skew_gap)),
            stay_bonus=knobs.stay_bonus + 3.0 * (want["stay"] - got.stay) / (1 - uniform_stay),
            affinity=max(0.0, knobs.affinity + 3.0 * (want["predictability"] - got.predictability)))
    return knobs


def _check(layers, experts, top_k, sequences, tokens, targets) -> None:
    for name, value, low in (("layers", layers, 1), ("experts", experts, 2), ("top_k", top_k, 1),
                             ("sequences", sequences, 1), ("tokens", tokens, 2)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
    if top_k >= experts:
        raise ValueError(f"top_k={top_k} must be below experts={experts}")
    if targets.entropy is not None and not 0 < targets.entropy < 1:
        raise ValueError(f"entropy={targets.entropy!r}: expected a normalized entropy in (0, 1)")
    if not 0 < targets.second_weight_median < 0.5 or not 0 < targets.second_weight_below_0_2 < 1:
        raise ValueError("second-weight targets: a median in (0, 0.5) and a share in (0, 1)")


def _weight_law(targets: RoutingTargets) -> tuple[float, float]:
    """(mu, sigma) of logit(2 w): median and share below 0.2 as targeted."""
    median = 2 * targets.second_weight_median
    mu = math.log(median / (1 - median))
    z = statistics.NormalDist().inv_cdf(targets.second_weight_below_0_2)
    sigma = (math.log(0.4 / 0.6) - mu) / z
    if sigma <= 0:
        raise ValueError("second-weight targets: a median above 0.2 needs a share below 0.2 under 0.5")
    return mu, sigma


def _sample(layers, experts, top_k, sequences, tokens, knobs: Knobs, targets: RoutingTargets,
            model_rng: np.random.Generator, rng: np.random.Generator) -> list[TraceRecord]:
    """model_rng draws the model's tables, rng the tokens."""
    popularity = np.maximum(model_rng.dirichlet(np.full(experts, knobs.concentration), size=layers), 1e-9)  # [L, E]
    buckets = min(math.comb(experts, top_k), MAX_FOLLOW_KEYS)
    follow = model_rng.dirichlet(np.full(experts, knobs.follow_concentration), size=(layers, buckets))  # [L, K, E]
    log_pop, log_follow = np.log(popularity), np.log(follow + 1e-12)
    radix = experts ** np.arange(top_k, dtype=np.int64)     # a sorted choice as a number (wraps if huge)
    mu, sigma = _weight_law(targets)
    previous = np.full((layers, sequences, experts), False)                 # chosen at the token before
    records = []
    for t in range(tokens):
        below = None                                                         # chosen at the layer before
        for l in range(layers):
            score = log_pop[l] + knobs.stay_bonus * previous[l] + rng.gumbel(size=(sequences, experts))
            if below is not None:
                key = (np.sort(below, axis=1) @ radix) % buckets                 # [S]: the choice's table
                score = score + knobs.affinity * log_follow[l][key]
            chosen = np.argsort(-score, axis=1)[:, :top_k]                   # [S, A], best first
            second = 0.5 / (1 + np.exp(-rng.normal(mu, sigma, size=sequences)))
            for s in range(sequences):
                records.append(TraceRecord(s, t, l, chosen[s].tolist(), _weights(top_k, second[s])))
            previous[l] = False
            np.put_along_axis(previous[l], chosen, True, axis=1)
            below = chosen
    return records


def _weights(top_k: int, second: float) -> list[float]:
    """The top-k's weights, summing to 1, falling with rank: the first two in the ratio the law drew
    (second / (first + second) = second), each further one half the one before."""
    if top_k == 1:
        return [1.0]
    raw = [1.0 - second, second] + [second / 2 ** i for i in range(1, top_k - 1)]
    return [round(w / sum(raw), 6) for w in raw]
