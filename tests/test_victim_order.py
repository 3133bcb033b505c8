"""A policy's resident_victim (the least of each layer's first keys, edgemoe/scheduling/policies.py
LayerOrder) picks exactly what victim() picks among every resident key that is not pinned: checked at
every eviction of random request streams, for every policy, in ghost caches and in the simulator's
tiers, and for frequency-distance scores that round equal."""

import pytest

from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.policies import POLICIES, GhostCache, LRUPolicy
from edgemoe.scheduling.profile import RoutingProfile
from edgemoe.scheduling.synthetic_routing import RoutingTargets, generate


def checked_victims(monkeypatch) -> list[int]:
    """Make every resident_victim call also compute victim() over the whole pool, and assert the two
    agree; returns a list whose length counts the checks."""
    checks = []
    fast = LRUPolicy.resident_victim

    def both(policy, pinned):
        pool = [k for layer in policy.resident.keys.values() for k in layer if k not in pinned]
        expected = policy.victim(pool) if pool else None
        got = fast(policy, pinned)
        assert got == expected, (policy.name, got, expected)
        checks.append(1)
        return got
    monkeypatch.setattr(LRUPolicy, "resident_victim", both)
    return checks


def routing(layers: int, experts: int, top_k: int, tokens: int, seed: int):
    records, _ = generate(layers, experts, top_k, 1, tokens, RoutingTargets(entropy=0.9), seed=seed)
    profile_records, _ = generate(layers, experts, top_k, 2, tokens, RoutingTargets(entropy=0.9), seed=seed + 1)
    profile = RoutingProfile.from_trace(profile_records, moe_layers=list(range(layers)), num_experts=experts,
                                        top_k=top_k)
    return sim.tokens_from_trace(records), profile


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"adaptive"}))
def test_ghost_victims_equal_the_whole_pools(monkeypatch, name):
    tokens, profile = routing(layers=5, experts=16, top_k=4, tokens=60, seed=3)
    popularity = {(l, e): p for l, row in profile.popularity.items() for e, p in enumerate(row)}
    checks = checked_victims(monkeypatch)
    for capacity in (6, 20, 40):
        ghost = GhostCache(POLICIES[name](5, popularity, profile), capacity)
        for token in tokens:
            for layer in sorted(token):
                ghost.run_layer(layer, {(layer, e): 1 for e in token[layer]})
    assert len(checks) > 500


def test_a_larger_frequency_whose_scaled_score_rounds_equal_wins_by_its_older_use():
    """Frequencies 3 and 3 + 2**-51 both score 2.7 at distance 1 of 10 layers: the tie goes to the
    least recently used, here the more frequent one, which the order within the layer puts second."""
    policy = POLICIES["frequency-distance"](10, {(5, 1): 2.0 ** -51})
    for key in ((5, 1), (5, 0)):            # (5, 1) first: the older use
        policy.insert(key)
        policy.touch(key)
        policy.touch(key)
    policy.set_layer(4)
    assert policy.score((5, 0)) == policy.score((5, 1)) and policy.frequency((5, 1)) > policy.frequency((5, 0))
    assert policy.victim([(5, 0), (5, 1)]) == (5, 1) == policy.resident_victim(())


@pytest.mark.parametrize("policy", ["adaptive", "expected-use", "frequency-distance"])
def test_the_simulators_tiers_agree_with_the_whole_pools(monkeypatch, policy):
    """The real cache's tiers (with the guard, preloads and their admission) ask the same question."""
    tokens, profile = routing(layers=4, experts=12, top_k=3, tokens=80, seed=5)
    checks = checked_victims(monkeypatch)
    for cache_experts in (5, 16):
        sim.simulate(tokens, cache_experts, policy, preload_profile=profile, guard=True)
    assert len(checks) > 100
