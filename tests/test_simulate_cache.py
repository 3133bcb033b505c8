"""tools/simulate_cache.py: hit rates computed by hand, Belady as the ceiling, preload with a perfect
profile, agreement with TieredStore on the same requests, and the command line."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

from edgemoe.store import convert, open_store
from edgemoe.store.policies import LFUPolicy
from edgemoe.store.profile import RoutingProfile, TraceRecord, write_trace

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("simulate_cache", REPO / "tools" / "simulate_cache.py")
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


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


# ---- the simulator agrees with the runtime ----------------------------------------------------------
@pytest.fixture(scope="module")
def store_dir(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "store"
    convert(tiny_model("mixtral"), out, bits=4)       # 2 MoE layers, 4 experts of equal size
    return out


@pytest.mark.parametrize("policy", sim.POLICY_NAMES)
def test_agrees_with_tiered_store(store_dir, policy):
    tokens = random_tokens(40, layers=(0, 1), num_experts=4, top_k=2, seed=1)
    with open_store(store_dir) as probe:
        size = probe.experts()[0].length
    with open_store(store_dir, ram=3 * size, policy=policy, place_popular=False) as store:
        for routing in tokens:
            for layer, experts in routing.items():
                store.begin_layer(layer, needed=[(layer, e) for e in experts])
                for e in sorted(experts):          # the runtime runs experts in ascending order
                    store.get(layer, e)
        runtime = store.stats
    simulated = sim.simulate(tokens, 3, policy)
    assert simulated["hits"] == runtime.ram.hits and simulated["evictions"] == runtime.ram.evictions
    assert simulated["hit_rate"] == pytest.approx(runtime.hit_rate)


# ---- command line -----------------------------------------------------------------------------------
def write_tokens(path, tokens):
    write_trace(path, [TraceRecord(0, t, l, list(experts), [1 / len(experts)] * len(experts))
                       for t, routing in enumerate(tokens) for l, experts in routing.items()])


def test_cli_json_and_table(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_tokens(trace, shifted_chain(40))
    assert sim.main([str(trace), "--cache-experts", "4", "6", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 2 * (2 * len(sim.POLICY_NAMES) + 1)
    assert {(r["policy"], r["preload"]) for r in records} >= {("belady", "none"), ("edgemoe", "correlation")}
    for r in records:
        assert set(r) >= {"policy", "preload", "cache_experts", "hit_rate", "preload_precision"}
        assert r["requests"] == 20 * 4 * 2                               # scored on the second half
        assert (r["preload_precision"] is None) == (r["preload"] == "none")
    other = tmp_path / "other.jsonl"
    write_tokens(other, shifted_chain(9))
    assert sim.main([str(trace), "--cache-experts", "6", "--profile-from", str(other)]) == 0
    out = capsys.readouterr().out
    assert f"profile: {other}; scored: all 40 tokens" in out and "belady" in out


def test_cli_model_layers_replays_the_trace_over_a_deeper_model(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_tokens(trace, shifted_chain(40))                               # 4 trace layers
    assert sim.main([str(trace), "--cache-experts", "8", "--model-layers", "10", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert all(r["requests"] == 20 * 10 * 2 for r in records)           # 10 layers per token, top-2
    with pytest.raises(SystemExit, match="--model-layers 0"):
        sim.main([str(trace), "--cache-experts", "8", "--model-layers", "0"])
