"""Which predictor a store preloads with, chosen by measurement when it is profiled.

Two predictors guess the experts of the next MoE layer (edgemoe.scheduling.preload): the correlation
table of the routing profile, and the gate look-ahead (the next layer's router on this layer's MoE
input). Which one predicts better depends on the model (on the bundled model the look-ahead did:
docs/scheduling.md), so profiling measures both on the profiling text and records the better one in
profile.json (edgemoe.store.profile_file); `preload="auto"` then uses it.

Measure: precision at top-k, on the same (token, layer) pairs for both: every MoE layer but the
first of its stack (the layers the preloader predicts), each predictor's A best guesses against the
A experts the router chose (so precision = recall). No leakage: the correlation table is built from
the first half of the text's tokens and both predictors are scored on the second half. The look-ahead
predictions come as a trace whose experts are the guesses for their (seq, token, layer)
(edgemoe.tracing.LookaheadRecorder).
"""

from __future__ import annotations

from .profile import RoutingProfile, tokens_from_trace

PREDICTOR_CHOICES = ("correlation", "lookahead")


def compare_predictors(records, lookahead, moe_layers, num_experts: int, top_k: int,
                       min_count: int = 3) -> dict | None:
    """{"predictor": the better one (correlation on a tie), "precision": {name: precision at top-k},
    "predictions": layers scored} from a text's trace `records` and its look-ahead trace; None when
    nothing can be scored (a text of one token, a model with one MoE layer per stack)."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r.seq, r.token), []).append(r)
    ids = list(groups)
    half = len(ids) // 2
    train = [r for key in ids[:half] for r in groups[key]]
    if not train:
        return None
    profile = RoutingProfile.from_trace(train, moe_layers=moe_layers, num_experts=num_experts, top_k=top_k,
                                        min_count=min_count)
    guesses = {(r.seq, r.token, r.layer): set(r.experts[:top_k]) for r in lookahead}
    hits = {"correlation": 0, "lookahead": 0}
    scored = 0
    for key in ids[half:]:
        routing = tokens_from_trace(groups[key])[0]
        history: dict[int, tuple[int, ...]] = {}
        for layer in sorted(routing):
            guess = guesses.get((*key, layer))
            if history and guess is not None:
                actual = set(routing[layer])
                correlation = {e for e, _ in profile.predict(layer, history)[:top_k]}
                hits["correlation"] += len(correlation & actual)
                hits["lookahead"] += len(guess & actual)
                scored += 1
            history[layer] = routing[layer]
    if not scored:
        return None
    precision = {name: count / (scored * top_k) for name, count in hits.items()}
    best = "lookahead" if precision["lookahead"] > precision["correlation"] else "correlation"
    return {"predictor": best, "precision": precision, "predictions": scored}
