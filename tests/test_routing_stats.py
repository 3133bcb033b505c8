"""Routing statistics of a trace, checked on traces whose statistics are known by construction, and
generated traces that meet their targets at any depth without repeating layers."""

import pytest

from edgemoe.scheduling.profile import TraceRecord
from edgemoe.scheduling.routing_stats import routing_statistics
from edgemoe.scheduling.synthetic_routing import RoutingTargets, generate


def trace(choice, layers=3, tokens=40, weights=(0.7, 0.3)):
    """choice(token, layer) -> experts."""
    return [TraceRecord(0, t, l, list(choice(t, l)), list(weights)) for t in range(tokens) for l in range(layers)]


def test_statistics_of_traces_known_by_construction():
    still = routing_statistics(trace(lambda t, l: (0, 1)))                       # same pair always
    assert still.stay == 1.0 and still.predictability == 1.0 and still.top_share == 0.5
    assert still.second_weight_median == pytest.approx(0.3) and still.second_weight_below_0_2 == 0.0
    cycle = [(0, 1), (2, 3), (4, 5), (6, 7)]
    rotating = routing_statistics(trace(lambda t, l: cycle[t % 4]))             # a new pair every token
    assert rotating.stay == 0.0 and rotating.experts == 8
    assert rotating.entropy == pytest.approx(1.0) and rotating.top_share == pytest.approx(1 / 8)
    assert rotating.predictability == 1.0                                        # layer l-1 tells layer l
    shifted = routing_statistics(trace(lambda t, l: cycle[(t + l * t) % 4]))    # layer l-1 tells less
    assert shifted.predictability < 1.0


@pytest.mark.parametrize("layers, experts, top_k", [(12, 8, 2), (6, 16, 4)])
def test_generated_traces_meet_their_targets(layers, experts, top_k):
    targets = RoutingTargets()
    records, stats = generate(layers, experts, top_k, sequences=8, tokens=48, targets=targets, seed=1)
    assert stats == routing_statistics(records)
    assert (stats.layers, stats.experts, stats.top_k, stats.tokens) == (layers, experts, top_k, 8 * 48)
    want = targets.absolute(experts, top_k)
    assert stats.stay == pytest.approx(want["stay"], abs=0.05)
    assert stats.top_share == pytest.approx(want["top_share"], rel=0.25)
    assert stats.second_weight_median == pytest.approx(targets.second_weight_median, abs=0.03)
    assert stats.second_weight_below_0_2 == pytest.approx(targets.second_weight_below_0_2, abs=0.05)
    by_layer = {}
    for r in records:
        by_layer.setdefault(r.layer, []).append(tuple(r.experts))
    assert len({tuple(v) for v in by_layer.values()}) == layers              # no layer repeats another


def test_mixtral_like_defaults_reproduce_the_measured_figures():
    _, stats = generate(32, 8, 2, sequences=8, tokens=48, seed=2)
    assert 0.34 <= stats.stay <= 0.40 and 0.17 <= stats.top_share <= 0.20
    assert 0.97 <= stats.entropy <= 0.99 and 0.43 <= stats.predictability <= 0.52


@pytest.mark.parametrize("entropy", [0.98, 0.85])
def test_an_entropy_target_sets_the_popularitys_skew(entropy):
    """Fine-grained routing (32 experts, top-4) from nearly flat to skewed, as public logs range."""
    _, stats = generate(6, 32, 4, sequences=8, tokens=48, targets=RoutingTargets(entropy=entropy), seed=1)
    assert stats.entropy == pytest.approx(entropy, abs=0.02)
    with pytest.raises(ValueError, match="entropy=1.2"):
        generate(6, 32, 4, sequences=2, tokens=4, targets=RoutingTargets(entropy=1.2))
