"""Adaptive eviction (edgemoe/scheduling/policies.py AdaptivePolicy): its ghost caches read what each
candidate policy alone reads (against plain reference implementations written here, and against the
simulator's real cache), on a deep model they see a sample of the layers, it follows the candidate
that wins on streams built so that LRU wins or LFU wins, and its guard holds preloads to the best
on-demand policy rather than to LRU."""

import random

import pytest

from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.cache import ExpertCache
from edgemoe.scheduling.guard import SchemeGuard
from edgemoe.scheduling.policies import POLICIES, AdaptivePolicy, GhostCache, RoutingShape, make_policy
from edgemoe.scheduling.profile import RoutingProfile


def random_tokens(n: int, layers=(0, 1, 2), num_experts: int = 6, top_k: int = 2, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    weights = [rng.random() ** 3 for _ in range(num_experts)]   # skewed popularity: frequency matters
    tokens = []
    for _ in range(n):
        routing = {}
        for l in layers:
            chosen = set()
            while len(chosen) < top_k:
                chosen.add(rng.choices(range(num_experts), weights)[0])
            routing[l] = tuple(chosen)
        tokens.append(routing)
    return tokens


# ---- plain reference implementations: a list of resident keys, the victim by its rule ---------------
def reference_misses(tokens, capacity: int, rule: str, num_layers: int) -> int:
    """On-demand caching of `capacity` experts, written from the policies' definitions: LRU evicts the
    least recently used; LFU the fewest uses (kept across evictions), then LRU; frequency-distance the
    lowest (1 + uses) * (L - d) / L, d = layers from the running one to the expert's, then LRU. A
    layer's own experts are never evicted for each other."""
    resident, last_use, uses, clock, misses = [], {}, {}, 0, 0
    for routing in tokens:
        for layer in sorted(routing):
            needed = {(layer, e) for e in routing[layer]}
            for key in sorted(needed):
                clock += 1
                if key not in resident:
                    misses += 1
                    if len(resident) == capacity:
                        pool = [k for k in resident if k not in needed]
                        if not pool:
                            continue
                        if rule == "lru":
                            victim = min(pool, key=lambda k: last_use[k])
                        elif rule == "lfu":
                            victim = min(pool, key=lambda k: (uses[k], last_use[k]))
                        else:
                            def score(k):
                                d = (k[0] - layer) % num_layers
                                return (1 + uses[k]) * (num_layers - d) / num_layers, last_use[k]
                            victim = min(pool, key=score)
                        resident.remove(victim)
                    resident.append(key)
                last_use[key] = clock
                uses[key] = uses.get(key, 0) + 1
    return misses


def ghost_misses(tokens, capacity: int, name: str, num_layers: int, profile=None) -> int:
    """The ghost's misses; with a profile, its policy gets the profile's popularity as the simulator passes it."""
    popularity = ({(l, e): p for l, row in profile.popularity.items() for e, p in enumerate(row)}
                  if profile else None)
    ghost = GhostCache(POLICIES[name](num_layers, popularity, profile), capacity)
    for routing in tokens:
        for layer in sorted(routing):
            ghost.run_layer(layer, {(layer, e): 1 for e in routing[layer]})
    return ghost.misses


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rule", ["lru", "lfu", "frequency-distance"])
def test_a_ghost_misses_what_the_plain_reference_of_its_policy_misses(rule, seed):
    tokens = random_tokens(80, seed=seed)
    for capacity in (2, 4, 7, 11):
        assert ghost_misses(tokens, capacity, rule, 3) == reference_misses(tokens, capacity, rule, 3), capacity


@pytest.mark.parametrize("name", ["lru", "lfu", "frequency-distance", "expected-use"])
def test_a_ghost_misses_what_the_real_cache_misses_under_its_policy(name):
    train = random_tokens(120, seed=7)
    profile = RoutingProfile([0, 1, 2], num_experts=6, top_k=2, min_count=1)
    for before, after in zip(train, train[1:]):
        profile.add_token(before)
        profile.add_pair(before, after)
    tokens = random_tokens(80, seed=8)
    for capacity in (3, 6, 10):
        simulated = sim.simulate(tokens, capacity, name, prior=profile)
        misses = simulated["requests"] - simulated["hits"]
        assert ghost_misses(tokens, capacity, name, 3, profile) == misses, capacity


# ---- following the best candidate ---------------------------------------------------------------------
def one_layer(experts) -> list[dict]:
    return [{0: (e,)} for e in experts]


def frequency_wins(rounds: int) -> list[int]:
    """Two hot experts between scans of three cold ones, never seen again: LRU loses the hot ones in
    every scan, LFU keeps them (3 slots: two hot, one for the scan)."""
    cold = iter(range(10, 10**6))
    return [e for _ in range(rounds) for e in (0, 1, 0, 1, next(cold), next(cold), next(cold))]


def recency_wins() -> list[int]:
    """Experts 0 and 1 used 60 times each, then a new working set of 2, 3, 4 in turn: LFU holds on to
    the old favourites (their counts outlive them), LRU turns over to the new set at once."""
    return [0, 1] * 60 + [2, 3, 4] * 40


def replay_adaptive(experts, capacity: int) -> tuple[dict, AdaptivePolicy]:
    cache = ExpertCache([("t", capacity)], lambda: AdaptivePolicy(1))
    hits = 0
    for e in experts:
        cache.begin_layer(0, {(0, e): 1})
        if cache.request((0, e)) is not None:
            hits += 1
        else:
            cache.place(sim._Expert((0, e)), "demand")
    return hits, cache.tiers[0].policy


@pytest.mark.parametrize("stream, winner, loser", [(frequency_wins(40), "lfu", "lru"),
                                                   (recency_wins(), "lru", "lfu")])
def test_adaptive_follows_the_candidate_that_misses_least(stream, winner, loser):
    tokens = one_layer(stream)
    best = sim.simulate(tokens, 3, winner)["hits"]
    worst = sim.simulate(tokens, 3, loser)["hits"]
    assert best > worst + 20
    hits, policy = replay_adaptive(stream, 3)
    assert policy.leader == winner or (winner == "lfu" and policy.leader == "frequency-distance")
    assert hits == sim.simulate(tokens, 3, "adaptive")["hits"]
    assert hits >= best - 0.1 * (best - worst)       # it pays a little for learning, not the loser's price


@pytest.mark.parametrize("counted_by", ["profile", "model"])
def test_on_a_fine_grained_model_the_ghosts_see_every_kth_layer_in_its_share_of_the_capacity(counted_by):
    """Set dueling's sampling: 24 MoE layers of top-8 (192 requests a token, counted from the routing
    profile, or from the model's shape where there is none), every third layer seen by the ghosts,
    each ghost a third of the capacity, read_bytes scaled back to every layer. On the frequency-wins
    stream in every layer the sampled ghosts still leave LRU. Top-2 (48 requests a token), or nothing
    to count by: every layer."""
    layers = 24
    stream = frequency_wins(30)
    profile = RoutingProfile(list(range(layers)), num_experts=128, top_k=8)
    policy = (AdaptivePolicy(layers, profile=profile) if counted_by == "profile"
              else make_policy("adaptive", layers, routing=RoutingShape(list(range(layers)), 8)))
    policy.set_capacity(3 * layers)
    assert policy.ghost_layers == set(range(0, layers, 3)) and policy.ghost_share == 1 / 3
    assert {ghost.capacity for ghost in policy.ghosts.values()} == {layers}
    seen = []
    run_layer = GhostCache.run_layer
    for ghost in policy.ghosts.values():
        ghost.run_layer = lambda layer, needed, ghost=ghost: seen.append(layer) or run_layer(ghost, layer, needed)
    for e in stream:
        for layer in range(layers):
            policy.set_layer(layer, {(layer, e): 1})
    assert set(seen) == policy.ghost_layers and len(seen) == len(policy.ghosts) * 8 * len(stream)
    assert policy.leader != "lru"
    reads = sorted(ghost.read_bytes for ghost in policy.ghosts.values())
    assert 3 * reads[0] <= policy.read_bytes <= 3 * reads[-1]     # the leaders' reads, scaled to every layer
    for unsampled in (AdaptivePolicy(layers, profile=RoutingProfile(list(range(layers)), 128, 2)),
                      AdaptivePolicy(layers, routing=RoutingShape(list(range(layers)), 2)),
                      AdaptivePolicy(layers), AdaptivePolicy(layers, profile=profile, ghost_requests=None)):
        assert unsampled.ghost_layers == set(range(layers)) and unsampled.ghost_share == 1


def test_a_fine_grained_store_without_a_routing_profile_samples_its_ghosts(tiny_model, tmp_path):
    """The store gives adaptive eviction the model's shape: 16 MoE layers of top-8 (128 requests a
    token) and no profile (converted without calibration text), so the ghosts see every second layer,
    as the simulator's on the same routing."""
    from edgemoe.convert import convert
    from edgemoe.store import TieredStore

    checkpoint = tiny_model("qwen3_moe", num_hidden_layers=16, num_experts=16, num_experts_per_tok=8)
    convert(checkpoint, tmp_path / "store", bits=4)
    with TieredStore(tmp_path / "store", ram="25%", policy="adaptive") as store:
        assert store.routing_profile is None
        adaptive = store.cache.tiers[-1].policy.primary
        assert adaptive.ghost_layers == set(range(0, 16, 2)) and adaptive.ghost_share == 1 / 2
    tokens = [{layer: tuple(range(8)) for layer in range(16)}] * 2   # room for all: the first token's misses
    sampled = {"lru": 8 * 8, "lfu": 8 * 8, "frequency-distance": 8 * 8}  # of the 8 layers seen, 8 experts each
    assert sim.simulate(tokens, 1000, "adaptive")["ghost_misses"] == sampled
    assert sim.simulate([], 1000, "adaptive")["hits"] == 0     # no tokens: no shape to sample by, no error


def test_the_leader_changes_only_past_the_margin():
    """Near-ties keep the leader: candidates that read within the margin of it over the window."""
    policy = AdaptivePolicy(1, margin=0.5)
    policy.set_capacity(3)
    for e in frequency_wins(40):
        policy.set_layer(0, {(0, e): 1})
    assert policy.leader == "lru" and policy.changes == []   # LFU's ghost reads 2/3 of LRU's: within 50%
    reads = dict(zip(policy.candidates, policy.window_reads))
    assert reads["lfu"] < reads["lru"] and reads["lfu"] >= 0.5 * reads["lru"]


def test_the_window_counts_only_recent_layers():
    policy = AdaptivePolicy(1, window_requests=10)
    policy.set_capacity(3)
    for e in recency_wins():
        policy.set_layer(0, {(0, e): 1})
    assert len(policy.window) == 10   # one request a layer call
    assert sum(policy.window_reads) == sum(sum(reads) for reads, _ in policy.window)
    assert dict(zip(policy.candidates, policy.window_reads))["lru"] == 0   # 2, 3, 4 cycle in 3 slots


def test_the_window_holds_a_number_of_requests_not_of_layer_calls():
    """The fewest latest layer calls holding at least window_requests requests: calls of 4 requests
    fill a window of 10 with 3 of them (12), and 2 calls (8) would be too few."""
    policy = AdaptivePolicy(1, window_requests=10)
    policy.set_capacity(8)
    for start in range(0, 40, 4):
        policy.set_layer(0, {(0, e): 1 for e in range(start % 12, start % 12 + 4)})
    assert [requests for _, requests in policy.window] == [4, 4, 4]
    assert sum(policy.window_reads) == sum(sum(reads) for reads, _ in policy.window)


# ---- the guard of an adaptive scheme -----------------------------------------------------------------
def test_the_guard_of_an_adaptive_scheme_measures_against_its_best_ghost():
    policy = AdaptivePolicy(1)
    guard = SchemeGuard(3, window_layers=8)
    ExpertCache([("t", 3)], lambda: policy, guard)
    assert guard.reference is policy and guard.lowest == 1   # never down to LRU: a candidate already
    plain = SchemeGuard(3, window_layers=8)
    ExpertCache([("t", 3)], lambda: POLICIES["lfu"](1), plain)
    assert plain.reference is None and plain.lowest == 2


def test_the_guard_of_an_adaptive_scheme_steps_down_where_preloads_read_more_than_the_best_ghost():
    """Real reads halfway between LFU's ghost and LRU's on a stream where LFU wins: preloading that
    beats LRU but not the best on-demand policy. The adaptive scheme's guard stops it, and stops at
    no-preload; a guard measuring against LRU keeps it."""
    stream = frequency_wins(40)
    lru = sim.simulate(one_layer(stream), 3, "lru")
    lfu = sim.simulate(one_layer(stream), 3, "lfu")
    per_layer = ((lru["requests"] - lru["hits"]) + (lfu["requests"] - lfu["hits"])) / 2 / len(stream)
    guards = {}
    for name in ("adaptive", "lru"):
        policy = POLICIES[name](1)
        policy.set_capacity(3)
        guard = guards[name] = SchemeGuard(3, window_layers=7)
        guard.measure_against(policy)
        for i, e in enumerate(stream):
            guard.observe_layer([((0, e), 1)], round(i * per_layer))   # as ExpertCache.begin_layer
            policy.set_layer(0, {(0, e): 1})
    entered = [name for _, name in guards["adaptive"].changes]
    assert entered[:1] == ["no-preload"] and "lru" not in entered
    assert guards["lru"].changes == []


def test_a_guarded_adaptive_scheme_reads_about_what_adaptive_eviction_alone_does():
    """Random routing: a profile's predictions are no better than chance, so preloads only add reads.
    The guard turns them off: the scheme reads about what adaptive eviction alone does (it pays its
    first window and its probes), less than LRU."""
    train, tokens = random_tokens(300, seed=1), random_tokens(400, seed=2)
    profile = RoutingProfile([0, 1, 2], num_experts=6, top_k=2, min_count=1)
    for before, after in zip(train, train[1:]):
        profile.add_token(before)
        profile.add_pair(before, after)
    on_demand = sim.simulate(tokens, 8, "adaptive", prior=profile)["reads_per_token"]
    lru = sim.simulate(tokens, 8, "lru")["reads_per_token"]
    guarded = sim.simulate(tokens, 8, "adaptive", profile, min_probability=0.3, guard=True)
    unguarded = sim.simulate(tokens, 8, "adaptive", profile, min_probability=0.3)
    assert unguarded["reads_per_token"] > 1.5 * on_demand and unguarded["preloads"] > 0
    assert guarded["reads_per_token"] <= 1.1 * on_demand and guarded["reads_per_token"] < lru


@pytest.mark.parametrize("tiers", [(("vram", 2), ("ram", 8)), (("ram", 8),)])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_hits_counted_in_bulk_are_what_requests_one_by_one_count(policy, tiers):
    """ExpertCache.count_hits, what a decode step with every expert resident records: the counters
    request() leaves for each key, in two tiers or one, a preloaded key's use and an urgent key's
    miss included; then with nothing preloaded or urgent left."""
    def filled():
        cache = ExpertCache(tiers, lambda: POLICIES[policy](2))
        for key in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            cache.place(sim._Expert(key), "placement")
        cache.place(sim._Expert((1, 2)), "preload")
        cache.place(sim._Expert((1, 3)), "urgent")
        return cache

    one_by_one, bulk = filled(), filled()
    assert one_by_one.resident() == bulk.resident()
    assert set(one_by_one.resident().values()) == {name for name, _ in tiers}
    for chosen in ([[0, 1], [0, 2, 3, 0]], [[0], [1, 2, 3]]):
        for layer, experts in enumerate(chosen):
            for expert in experts:
                one_by_one.request((layer, expert))
        bulk.count_hits(0, chosen)
        assert one_by_one.stats == bulk.stats
        assert one_by_one.stats.preloads_used == 1 and one_by_one.stats.misses == 1
    assert bulk.stats.hits == 9 and all(tier.hits > 0 for tier in bulk.stats.tiers.values())


def test_a_resized_tier_keeps_what_fits_and_its_ghosts_and_guard_follow():
    """ExpertCache.resize_last_tier (--ram auto's second look): grown, nothing leaves the tier,
    adaptive eviction's ghosts keep their keys and take the new capacity, so does the guard's ghost,
    and the room is then filled; made smaller again, the tier evicts by its policy until it fits."""
    def replay(cache, tokens):
        for routing in tokens:
            for layer in sorted(routing):
                needed = {(layer, e): 1 for e in routing[layer]}
                cache.begin_layer(layer, needed)
                for key in sorted(needed):
                    if cache.request(key) is None:
                        cache.place(sim._Expert(key), "demand")

    tokens = random_tokens(200, seed=3)
    guard = SchemeGuard(4, window_layers=8)
    cache = ExpertCache([("ram", 4)], lambda: AdaptivePolicy(3), guard)
    tier, adaptive = cache.tiers[-1], cache.tiers[-1].policy.primary
    replay(cache, tokens[:100])
    resident, ghosts = cache.resident(), {n: dict(g.items) for n, g in adaptive.ghosts.items()}
    assert tier.stats.peak_bytes == 4
    cache.resize_last_tier(7)
    assert cache.resident() == resident and {n: dict(g.items) for n, g in adaptive.ghosts.items()} == ghosts
    assert tier.capacity == guard.ghost.budget == 7 and all(g.capacity == 7 for g in adaptive.ghosts.values())
    replay(cache, tokens[100:])
    assert tier.stats.bytes == 7
    victim = tier.policy.resident_victim(cache.pinned)     # never the running layer's experts
    cache.resize_last_tier(6)
    assert victim not in cache.resident() and len(cache.resident()) == 6
    cache.resize_last_tier(5)
    assert tier.stats.bytes == len(cache.resident()) == 5
    assert tier.capacity == guard.ghost.budget == 5 and all(g.capacity == 5 for g in adaptive.ghosts.values())
