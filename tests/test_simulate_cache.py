"""edgemoe/scheduling/simulate.py: hit rates computed by hand, Belady as the ceiling, preload with a perfect
profile, the expected-use policy and its preload admission by hand, agreement with TieredStore on the
same requests (with and without preload), and the command line."""

import json
import random
import shutil

import pytest

from edgemoe.store.profile_file import save_routing_profile
from edgemoe.store import open_store
from edgemoe.convert import convert
from edgemoe.scheduling.preload import MIN_PROBABILITY
from edgemoe.scheduling.policies import ExpectedUsePolicy, LFUPolicy, LRUPolicy
from edgemoe.scheduling.profile import RoutingProfile, TraceRecord, write_trace
from edgemoe.loader import StoreOptions
from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.cache import Tier, TierStats
from edgemoe.cli import main


def one_layer(experts) -> list[dict]:
    """Top-1 tokens of a single MoE layer 0."""
    return [{0: (e,)} for e in experts]


def random_tokens(n: int, layers=(0, 1, 2), num_experts: int = 6, top_k: int = 2, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{l: tuple(rng.sample(range(num_experts), top_k)) for l in layers} for _ in range(n)]


def shifted_chain(n: int, layers=(0, 1, 2, 3), num_experts: int = 6) -> list[dict]:
    """Top-2: layer 0 = (0, a) with a cycling over 1..3; each layer's experts are the previous layer's + 1
    (mod E), so layers >= 1 are determined by the layer before, and expert 0 is certain at layer 0."""
    tokens = []
    for t in range(n):
        experts, routing = (0, 1 + t % 3), {}
        for l in layers:
            routing[l] = experts
            experts = tuple((e + 1) % num_experts for e in experts)
        tokens.append(routing)
    return tokens


# ---- by hand ----------------------------------------------------------------------------------------
def test_hand_computed_hit_rates():
    tokens = one_layer([0, 1, 0, 2, 1, 0])
    # LRU, 2 slots: m m h m(evict 1) m(evict 0) m(evict 2)
    assert sim.simulate(tokens, 2, "lru")["hits"] == 1
    # LFU: 2 evicts 1 (1 access vs 2); 1 evicts 2 (tie at 1 access: LRU); 0 hits
    assert sim.simulate(tokens, 2, "lfu")["hits"] == 2
    # Belady: 2 evicts 0 (next use at 5, after 1's at 4); 1 hits; 0 misses
    assert sim.simulate(tokens, 2, "belady")["hits"] == 2
    lru = sim.simulate(tokens, 2, "lru")
    assert lru["hit_rate"] == pytest.approx(1 / 6) and lru["evictions"] == 3 and lru["preload_precision"] is None


def test_lfu_counts_survive_eviction_and_insert_is_not_an_access():
    policy = LFUPolicy(1)
    for key, touches in (((0, 0), 3), ((0, 1), 1)):
        policy.insert(key)
        for _ in range(touches):
            policy.touch(key)
    policy.remove((0, 0))
    policy.insert((0, 0))               # back, with its 3 accesses
    policy.insert((0, 2))               # fresh: no access yet
    assert policy.victim([(0, 0), (0, 1), (0, 2)]) == (0, 2)
    assert policy.victim([(0, 0), (0, 1)]) == (0, 1)
    # Belady beats LFU when the past misleads: 0 was hot, 1 and 2 alternate
    tokens = one_layer([0, 0, 0, 1, 2, 1, 2, 1, 2])
    assert sim.simulate(tokens, 2, "lfu")["hits"] == 2
    assert sim.simulate(tokens, 2, "belady")["hits"] == 6


def belady_hits_brute_force(tokens, capacity: int) -> int:
    keys = [(l, e) for routing in tokens for l in sorted(routing) for e in sorted(routing[l])]
    resident, hits = set(), 0
    for i, key in enumerate(keys):
        if key in resident:
            hits += 1
            continue
        if len(resident) >= capacity:
            future = keys[i + 1:]
            resident.remove(max(resident, key=lambda k: future.index(k) if k in future else len(keys)))
        resident.add(key)
    return hits


@pytest.mark.parametrize("seed", range(5))
def test_belady_is_the_ceiling(seed):
    tokens = random_tokens(60, seed=seed)
    for capacity in (2, 5, 9):
        belady = sim.simulate(tokens, capacity, "belady")
        assert belady["hits"] == belady_hits_brute_force(tokens, capacity)
        best = belady["hit_rate"]
        for policy in sim.POLICY_NAMES:
            assert sim.simulate(tokens, capacity, policy)["hit_rate"] <= best + 1e-12, (policy, capacity)


# ---- preload ----------------------------------------------------------------------------------------
def test_preload_with_a_perfect_profile():
    tokens = shifted_chain(60)
    profile = RoutingProfile([0, 1, 2, 3], num_experts=6, top_k=2)
    for routing in tokens:
        profile.add_token(routing)
    for policy in sim.POLICY_NAMES:
        plain = sim.simulate(tokens, 6, policy, prior=profile)
        preloaded = sim.simulate(tokens, 6, policy, preload_profile=profile, preload_k=1)
        assert preloaded["preloads"] > 0 and preloaded["preload_precision"] == 1.0, policy
        assert preloaded["hit_rate"] > plain["hit_rate"], policy


def test_preload_never_evicts_this_layers_preloads():
    """One slot, k=2: the second preload may not evict the first, so only one is made per layer."""
    tokens = shifted_chain(6)
    profile = RoutingProfile([0, 1, 2, 3], num_experts=6, top_k=2)
    for routing in tokens:
        profile.add_token(routing)
    result = sim.simulate(tokens, 1, "lru", preload_profile=profile, preload_k=2)
    assert result["preloads"] <= 6 * 4 and result["preload_precision"] == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="--cache-experts 0"):
        sim.simulate(one_layer([0]), 0, "lru")
    with pytest.raises(ValueError, match="expected one of"):
        sim.simulate(one_layer([0]), 1, "fifo")
    with pytest.raises(ValueError, match="do not cover"):
        sim.simulate([{5: (0,)}], 1, "lru", preload_profile=RoutingProfile([0], 2, 1))


# ---- expected use: estimates, victims and admission by hand ----------------------------------------
def hand_profile() -> RoutingProfile:
    """Top-1, 3 layers, 4 experts. Per layer, of 10 token pairs: expert 0 starts 4 and stays in 2
    (stay 1/2, arrive 2/6), expert 1 starts 2 and never stays (stay 0, arrive 2/8). Layer 1 after
    expert 0 at layer 0 is expert 2, always."""
    profile = RoutingProfile([0, 1, 2], num_experts=4, top_k=1, min_count=1)
    profile.add_token({0: (0,), 1: (2,), 2: (3,)})
    for l in profile.moe_layers:
        profile.pairs[l], profile.before[l], profile.after[l], profile.both[l] = 10, [4, 2, 2, 2], [4, 2, 2, 2], [2, 0, 0, 0]
    return profile


def test_expected_use_estimates_and_victims_by_hand():
    policy = ExpectedUsePolicy(3, profile=hand_profile())
    policy.set_layer(0, {(0, 0)})
    assert policy.estimate((0, 0)) == 0.5                  # used by the running layer: stay
    assert policy.estimate((0, 1)) == 0.25                 # not used: arrive
    assert policy.estimate((1, 2)) == 1.0 and policy.estimate((1, 1)) == 0.0   # next layer: predict
    assert policy.estimate((2, 0)) == pytest.approx(1 / 3)  # layer 2 has not run: arrive
    assert [policy.distance(k) for k in ((1, 2), (2, 0), (0, 0))] == [1, 2, 3]
    # expected uses per layer held: (1,1) 0, (0,1) 0.25/3, (2,1) 0.25/2, (2,0) 1/6 = (0,0) 0.5/3, (1,2) 1
    resident = [(0, 0), (0, 1), (1, 1), (1, 2), (2, 1)]
    order = []
    while resident:
        order.append(policy.victim(resident))
        resident.remove(order[-1])
    assert order == [(1, 1), (0, 1), (2, 1), (0, 0), (1, 2)]
    policy.set_layer(1, {(1, 2)})
    policy.set_layer(2, {(2, 3)})
    policy.set_layer(0, {(0, 1)})                          # a new step: (0, 0) was not used by it
    assert policy.step == 1 and policy.estimate((0, 0)) == pytest.approx(1 / 3)
    assert policy.estimate((2, 3)) == 0.0                  # used by layer 2's last run (step 0): stay 0/2
    assert policy.estimate((2, 0)) == pytest.approx(1 / 3)  # not used by it: arrive


def test_admission_weighs_a_preload_against_its_victim():
    """Admit p if p > (1 - p)(1 + q): q = the victim's estimate, 0 in free room."""
    policy = ExpectedUsePolicy(3, profile=hand_profile())
    policy.set_layer(0, {(0, 0)})
    assert policy.admits(0.6, (0, 1))                      # 0.6 > 0.4 * 1.25
    assert not policy.admits(0.55, (0, 1))                 # 0.55 < 0.45 * 1.25
    assert not policy.admits(0.6, (0, 0))                  # 0.6 < 0.4 * 1.5
    assert policy.admits(0.51, None) and not policy.admits(0.5, None)
    assert LRUPolicy().admits(0.01, (0, 1))                # the other policies admit every preload


def test_tier_admit_gives_each_preload_its_own_victim():
    policy = ExpectedUsePolicy(3, profile=hand_profile())
    tier = Tier("t", 3, policy, TierStats())
    for key in ((0, 0), (0, 1), (2, 1)):
        tier.put(sim._Expert(key))
    policy.set_layer(0, {(0, 0)})
    # (1,2) displaces (0,1) (q 1/4); (1,3) then displaces (2,1) (q 1/4, 0.6 > 0.5); (1,0) finds no victim
    assert tier.admit([((1, 2), 1, 0.9), ((1, 3), 1, 0.6), ((1, 0), 1, 0.9)], protect={(0, 0)}) == [(1, 2), (1, 3)]
    assert tier.admit([((1, 2), 1, 0.9), ((1, 3), 1, 0.55)], protect={(0, 0)}) == [(1, 2)]   # 0.55 < 0.5625
    assert tier.admit([((1, 2), 1, 0.9)], protect={(0, 0), (0, 1), (2, 1)}) == []
    assert set(tier.items) == {(0, 0), (0, 1), (2, 1)}    # admit only decides
    roomy = Tier("t", 4, policy, TierStats())
    roomy.put(sim._Expert((0, 1)))
    assert roomy.admit([((1, 2), 1, 0.9), ((1, 3), 1, 0.5)]) == [(1, 2)]   # free room: p > 0.5


# ---- the simulator agrees with the runtime ----------------------------------------------------------
@pytest.fixture(scope="module")
def store_dir(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "store"
    convert(tiny_model("mixtral"), out, bits=4)       # 2 MoE layers, 4 experts of equal size
    return out


@pytest.mark.parametrize("guard", [False, True])
@pytest.mark.parametrize("policy", sim.POLICY_NAMES)
def test_agrees_with_tiered_store(store_dir, policy, guard):
    tokens = random_tokens(40, layers=(0, 1), num_experts=4, top_k=2, seed=1)
    with open_store(store_dir) as probe:
        size = probe.experts()[0].length
    with open_store(store_dir, ram=3 * size, policy=policy, place_popular=False, guard=guard) as store:
        for routing in tokens:
            for layer, experts in routing.items():
                store.begin_layer(layer, needed=[(layer, e) for e in experts])
                for e in sorted(experts):          # the runtime runs experts in ascending order
                    store.get(layer, e)
        runtime = store.stats
    simulated = sim.simulate(tokens, 3, policy, guard=guard)
    assert simulated["hits"] == runtime.ram.hits and simulated["evictions"] == runtime.ram.evictions
    assert simulated["hit_rate"] == pytest.approx(runtime.hit_rate)


def correlated_tokens(n: int, seed: int) -> list[dict]:
    """2 layers, 4 experts, top-2: layer 1 is layer 0 shifted by one, 4 times in 5."""
    rng, tokens = random.Random(seed), []
    for _ in range(n):
        first = tuple(rng.sample(range(4), 2))
        second = tuple((e + 1) % 4 for e in first) if rng.random() < 0.8 else tuple(rng.sample(range(4), 2))
        tokens.append({0: first, 1: second})
    return tokens


@pytest.mark.parametrize("guard", [False, True])
def test_expected_use_with_preload_agrees_with_tiered_store(store_dir, tmp_path, guard):
    """Same requests, same predictions: the runtime (TieredStore.admit, then prefetch) loads, hits and
    evicts exactly as the simulator, with or without the guard."""
    profile = RoutingProfile([0, 1], num_experts=4, top_k=2)
    train = correlated_tokens(200, seed=2)
    for before, after in zip(train, train[1:]):
        profile.add_token(before)
        profile.add_pair(before, after)
    store = tmp_path / "store"
    shutil.copytree(store_dir, store)
    save_routing_profile(store, profile)
    tokens = correlated_tokens(60, seed=3)
    with open_store(store) as probe:
        size = probe.experts()[0].length
    with open_store(store, ram=3 * size, policy="expected-use", place_popular=False, guard=guard) as s:
        for routing in tokens:
            s.begin_layer(0, needed=[(0, e) for e in routing[0]])
            wanted = [((1, e), p) for e, p in profile.predict(1, {0: routing[0]})[:2] if p >= MIN_PROBABILITY]
            s.prefetch(s.admit(wanted))
            s.drain()
            for layer in (0, 1):
                if layer:
                    s.begin_layer(1, needed=[(1, e) for e in routing[1]])
                for e in sorted(routing[layer]):
                    s.get(layer, e)
        runtime = s.stats
    simulated = sim.simulate(tokens, 3, "expected-use", preload_profile=profile, guard=guard)
    assert 0 < simulated["preloads"] < 60 * 2                  # some admitted, some not
    assert simulated["preloads"] == runtime.preloads_loaded
    assert simulated["hits"] == runtime.ram.hits and simulated["evictions"] == runtime.ram.evictions


# ---- command line -----------------------------------------------------------------------------------
def write_tokens(path, tokens):
    write_trace(path, [TraceRecord(0, t, l, list(experts), [1 / len(experts)] * len(experts))
                       for t, routing in enumerate(tokens) for l, experts in routing.items()])


def simulate_cli(monkeypatch, capsys, *args) -> str:
    """`edgemoe simulate ARGS` in-process: its stdout (it must succeed)."""
    monkeypatch.setattr("sys.argv", ["edgemoe", "simulate", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    return captured.out


def test_cli_json_and_table(tmp_path, monkeypatch, capsys):
    trace = tmp_path / "trace.jsonl"
    write_tokens(trace, shifted_chain(40))
    records = json.loads(simulate_cli(monkeypatch, capsys, str(trace), "--cache-experts", "4",
                                      "--cache-experts", "6", "--json"))
    assert len(records) == 2 * (2 * len(sim.POLICY_NAMES) + 2)   # + the default scheme, + Belady
    assert {(r["policy"], r["preload"]) for r in records} >= {("belady", "none"), ("frequency-distance", "correlation")}
    defaults = [r for r in records if r["default"]]
    assert [r["cache_experts"] for r in defaults] == [4, 6]
    assert all((r["policy"], r["preload"], r["guard"]) == (StoreOptions().policy, "correlation", True) for r in defaults)
    guarded = json.loads(simulate_cli(monkeypatch, capsys, str(trace), "--cache-experts", "4", "--guard", "--json"))
    assert sum(r["default"] for r in guarded) == 1 and len(guarded) == 4 * len(sim.POLICY_NAMES) + 1
    for r in records:
        assert set(r) >= {"policy", "preload", "cache_experts", "hit_rate", "preload_precision"}
        assert r["requests"] == 20 * 4 * 2                               # scored on the second half
        assert (r["preload_precision"] is None) == (r["preload"] == "none")
    other = tmp_path / "other.jsonl"
    write_tokens(other, shifted_chain(9))
    out = simulate_cli(monkeypatch, capsys, str(trace), "--cache-experts", "6", "--profile-from", str(other))
    assert f"profile: {other}; scored: all 40 tokens" in out and "belady" in out


def test_cli_prints_the_traces_routing_statistics(tmp_path, monkeypatch, capsys):
    trace = tmp_path / "trace.jsonl"
    write_tokens(trace, shifted_chain(40))                               # 4 trace layers
    out = simulate_cli(monkeypatch, capsys, str(trace), "--cache-experts", "8", "--stats")
    assert "40 tokens, 4 MoE layers" in out and "stay probability" in out and "belady" in out
