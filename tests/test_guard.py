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


def test_preloads_that_add_io_wait_are_turned_off_though_they_read_no_more_bytes():
    """Time as well as bytes: windows with preloads whose callers waited longer than the windows
    without preloads did per byte of on-demand reads step the scheme down; waiting less keeps it."""
    guard = SchemeGuard(budget=2, window_layers=4, probe_every=2)
    key = iter(range(10**6))
    real = wait = 0
    preloads = 0

    def window(wait_per_read, preloading):
        nonlocal real, wait, preloads
        for _ in range(4):                     # a new expert per layer: the ghost and the store read 1 each
            real += 1
            wait += wait_per_read
            preloads += preloading
            guard.observe_time(wait, preloads, read_seconds_per_byte=0.01)
            guard.observe_layer([((0, next(key)), 1)], real)

    window(0.005, preloading=True)             # before any measurement the disk's 0.01 s per byte is the bar
    assert LEVELS[guard.level] == "full"
    window(0.02, preloading=True)              # preloads made every read wait twice the disk's time
    assert LEVELS[guard.level] == "no-preload" and guard.slower_windows == 1
    window(0.004, preloading=False), window(0.004, preloading=False)   # on demand: 4 ms per byte, measured
    assert guard.wait_per_byte == pytest.approx(0.004)
    assert LEVELS[guard.level] == "full"       # the probe
    window(0.005, preloading=True)             # 25% more wait than on demand: the probe failed
    assert LEVELS[guard.level] == "no-preload" and guard.slower_windows == 2
    window(0.004, preloading=False)            # without preloads nothing is judged on time
    assert LEVELS[guard.level] == "no-preload" and guard.slower_windows == 2


def test_without_preloads_the_clock_changes_nothing(routing):
    """A store with no preloader feeds its waits too: the guard steps as the simulator's does."""
    tokens, _ = routing
    steps = []
    for clock in (False, True):
        guard = SchemeGuard(budget=12, window_layers=16)
        read = 0
        for i, token in enumerate(tokens):
            for layer in sorted(token):
                needed = [((layer, e), 1) for e in sorted(token[layer])]
                read += sum(k not in guard.ghost.items for k, _ in needed) + (i % 3 == 0)   # a worse scheme
                if clock:
                    guard.observe_time(wait_seconds=0.5 * i, preloads=0, read_seconds_per_byte=1e-9)
                guard.observe_layer(needed, read)
        steps.append(guard.changes)
    assert steps[0] == steps[1] and steps[0]
