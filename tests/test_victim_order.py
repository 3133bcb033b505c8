"""A policy's resident_victim (the least of each layer's first keys, edgemoe/scheduling/policies.py
LayerOrder) picks exactly what victim() picks among every resident key that is not pinned: checked at
every eviction of random request streams, for every policy, in ghost caches and in the simulator's
tiers; and frequency-distance's exact scores."""

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


def test_frequency_distance_scores_are_exact_at_every_distance():
    """Frequencies 3 and 3 + 2**-20 (a prior of the scores' unit) would round equal as floats times
    (L - d) / L at some distance; kept exact, the larger one scores higher at every distance, so the
    order within a layer is the victim order, and the less frequent goes although used later."""
    policy = POLICIES["frequency-distance"](10, {(5, 1): 2.0 ** -20})
    for key in ((5, 1), (5, 0)):            # (5, 1) first: the older use
        policy.insert(key)
        policy.touch(key)
        policy.touch(key)
    for running in range(10):
        policy.set_layer(running)
        assert policy.score((5, 0)) < policy.score((5, 1))
        assert policy.victim([(5, 0), (5, 1)]) == (5, 0) == policy.resident_victim(())


def test_frequency_distance_ties_across_layers_go_to_the_least_recently_used():
    """With layer 0 running (4 layers), frequency 1 at distance 0 scores 1 x 4, and frequency 2 at
    distance 2 scores 2 x 2: a tie, which the older use loses, however frequent."""
    for events, older in ((["insert 0", "insert 2", "touch 2"], (0, 0)),
                          (["insert 2", "touch 2", "insert 0"], (2, 0))):
        policy = POLICIES["frequency-distance"](4)
        for event in events:
            action, layer = event.split()
            getattr(policy, action)((int(layer), 0))
        policy.set_layer(0)
        assert policy.score((0, 0)) == policy.score((2, 0))
        assert policy.victim([(0, 0), (2, 0)]) == older == policy.resident_victim(())


@pytest.mark.parametrize("policy", ["adaptive", "expected-use", "frequency-distance"])
def test_the_simulators_tiers_agree_with_the_whole_pools(monkeypatch, policy):
    """The real cache's tiers (with the guard, preloads and their admission) ask the same question."""
    tokens, profile = routing(layers=4, experts=12, top_k=3, tokens=80, seed=5)
    checks = checked_victims(monkeypatch)
    for cache_experts in (5, 16):
        sim.simulate(tokens, cache_experts, policy, preload_profile=profile, guard=True)
    assert len(checks) > 100
