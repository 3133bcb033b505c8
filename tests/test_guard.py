"""The scheme guard: a ghost LRU that counts exactly what on-demand LRU reads, and a scheme that falls
back when it reads more than that ghost, so the guarded scheme reads at most about what LRU does."""

import pytest

from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.guard import LEVELS, GhostLRU, SchemeGuard
from edgemoe.scheduling.profile import RoutingProfile, tokens_from_trace
from edgemoe.scheduling.synthetic_routing import generate



@pytest.fixture(scope="module")
def routing():
    """Mixtral-like routing over 8 layers: a text to profile and another to score."""
    profiled, _ = generate(8, 8, 2, sequences=4, tokens=64, seed=1)
    scored, _ = generate(8, 8, 2, sequences=4, tokens=96, seed=0)
    profile = RoutingProfile.from_trace(profiled, moe_layers=list(range(8)), num_experts=8, top_k=2)
    return tokens_from_trace(scored), profile


def test_the_ghost_reads_what_on_demand_lru_reads(routing):
    tokens, _ = routing
    for capacity in (6, 16, 24):
        ghost = GhostLRU(capacity)
        for token in tokens:
            for layer in sorted(token):
                needed = frozenset((layer, e) for e in token[layer])
                for e in sorted(token[layer]):
                    ghost.request((layer, e), 1, needed - {(layer, e)})
        lru = sim.simulate(tokens, capacity, "lru")
        assert ghost.read_bytes == lru["requests"] - lru["hits"]


@pytest.mark.parametrize("capacity", [12, 16, 24])   # below, at and above one token's 16 experts
@pytest.mark.parametrize("policy", ["lru", "expected-use"])
def test_a_guarded_scheme_reads_about_what_lru_does_where_its_preloads_do_not_pay(routing, capacity, policy):
    tokens, profile = routing
    lru = sim.simulate(tokens, capacity, "lru")["reads_per_token"]
    free = sim.simulate(tokens, capacity, policy, profile)["reads_per_token"]
    guarded = sim.simulate(tokens, capacity, policy, profile, guard=True)["reads_per_token"]
    assert guarded <= max(lru, free)
    assert guarded <= 1.05 * lru or guarded <= free   # 384 tokens: a short run pays its first window


def test_the_guard_steps_down_when_worse_and_probes_back():
    guard = SchemeGuard(budget=2, window_layers=4, probe_every=2)
    key = iter(range(10**6))
    real = 0

    def window(extra_reads):
        nonlocal real
        for _ in range(4):                     # a new expert per layer: the ghost reads 1 each
            real += 1 + extra_reads
            guard.observe_layer([((0, next(key)), 1)], real)

    window(1)
    assert LEVELS[guard.level] == "no-preload"
    window(1)
    assert LEVELS[guard.level] == "lru" and not guard.allow_preload and guard.use_lru
    window(0), window(0)                       # two good windows at the bottom: probe the level above
    assert LEVELS[guard.level] == "no-preload"
    window(0)                                  # the probe was not worse: stay
    assert LEVELS[guard.level] == "no-preload"
    assert [name for _, name in guard.changes] == ["no-preload", "lru", "no-preload"]
