"""Routing traces and the routing profile: trace I/O and errors, correlation counts and back-off,
predictions on a deterministic chain, profile.json round trip, predictor quality, TraceRecorder."""

import json

import pytest
import torch

import edgemoe
from edgemoe.store.profile_file import load_routing_profile, save_routing_profile
from edgemoe.model import Segment
from edgemoe.layers import route
from edgemoe.store import StoreError, open_store
from edgemoe.convert import convert
from edgemoe.scheduling.profile import (RoutingProfile, TraceRecord, predictor_quality, read_trace, tokens_from_trace,
                                   write_trace)
from edgemoe.tracing import TraceRecorder


def chain_tokens(n: int, layers=(0, 1, 2, 3), num_experts: int = 4) -> list[dict]:
    """Top-1 tokens where layer l's expert = (layer l-1's + 1) mod E: fully determined by layer 0."""
    tokens = []
    for t in range(n):
        e, routing = t % num_experts, {}
        for l in layers:
            routing[l] = (e,)
            e = (e + 1) % num_experts
        tokens.append(routing)
    return tokens


# ---- traces -----------------------------------------------------------------------------------------
def test_trace_round_trip_and_grouping(tmp_path):
    records = [TraceRecord(0, 0, 1, [2, 0], [0.7, 0.3]), TraceRecord("b", 4, 1, [1, 3], [0.6, 0.4]),
               TraceRecord(0, 0, 3, [0, 1], [0.5, 0.5]), TraceRecord(0, 1, 1, [3, 2], [0.9, 0.1]),
               TraceRecord("b", 4, 3, [2, 3], [0.8, 0.2])]
    path = tmp_path / "t.jsonl"
    write_trace(path, records)
    assert read_trace(path) == records
    assert tokens_from_trace(records) == [{1: (2, 0), 3: (0, 1)}, {1: (1, 3), 3: (2, 3)}, {1: (3, 2)}]


@pytest.mark.parametrize("line, message", [
    ('{"seq": 0, "token": 0, "layer": 0, "experts": [1]', "malformed"),
    ('{"seq": 0, "token": 0, "layer": 0, "experts": [1]}', "weights"),
    ('{"seq": 0, "token": 0, "layer": 0, "experts": [1, 1], "weights": [0.5, 0.5]}', "twice"),
    ('{"seq": 0, "token": -1, "layer": 0, "experts": [1], "weights": [1.0]}', "token=-1"),
    ('{"seq": 0, "token": 0, "layer": 0, "experts": [1], "weights": [0.5, 0.5]}', "weights"),
    ('[1, 2]', "object"),
])
def test_read_trace_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = '{"seq": 0, "token": 0, "layer": 0, "experts": [1], "weights": [1.0]}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        read_trace(path)


def test_duplicate_record_is_an_error():
    r = TraceRecord(0, 0, 0, [1], [1.0])
    with pytest.raises(ValueError, match="two records for seq=0 token=0 layer=0"):
        tokens_from_trace([r, r])


# ---- profile: counts and back-off -------------------------------------------------------------------
def test_correlation_counts_top2():
    profile = RoutingProfile([0, 2, 5], num_experts=6, top_k=2)
    profile.add_token({0: (3, 0), 2: (5, 1), 5: (2, 4)})
    profile.add_token({0: (0, 3), 2: (1, 5), 5: (4, 0)})
    d = profile.to_json()
    assert d["counts"]["0"] == [2, 0, 0, 2, 0, 0]
    assert d["given_prev"]["2"] == {"0,3": {"seen": 2, "counts": {"1": 2, "5": 2}}}
    assert d["given_prev"]["5"] == {"1,5": {"seen": 2, "counts": {"0": 1, "2": 1, "4": 2}}}
    assert d["given_prev2"]["5"] == {"1,5|0,3": {"seen": 2, "counts": {"0": 1, "2": 1, "4": 2}}}
    assert d["given_prev2"]["2"] == {} and d["given_prev"]["0"] == {}
    assert profile.popularity[5] == [0.25, 0, 0.25, 0, 0.5, 0]


def test_back_off_order():
    """(l-1, l-2) key seen >= min_count -> that table; else the l-1 key; else popularity."""
    profile = RoutingProfile([0, 1, 2], num_experts=4, top_k=1, min_count=2)
    for _ in range(2):
        profile.add_token({0: (0,), 1: (1,), 2: (2,)})      # key "1|0" -> 2, seen twice
    profile.add_token({0: (3,), 1: (1,), 2: (3,)})          # key "1|3" -> 3, seen once
    profile.add_token({0: (3,), 1: (0,), 2: (0,)})          # l-1 key "0" seen once
    assert profile.source(2, {0: (0,), 1: (1,)}) == "l-1,l-2"
    assert profile.predict(2, {0: (0,), 1: (1,)})[0] == (2, 1.0)
    # rare (l-1, l-2) key: P(e | l-1 = 1) from 3 tokens: 2 chose 2, 1 chose 3
    assert profile.source(2, {0: (3,), 1: (1,)}) == "l-1"
    assert profile.predict(2, {0: (3,), 1: (1,)})[:2] == [(2, pytest.approx(2 / 3)), (3, pytest.approx(1 / 3))]
    # l-1 key rare too: popularity at layer 2 (2: 2/4, then 0 and 3: 1/4, tie broken by id)
    assert profile.source(2, {0: (3,), 1: (0,)}) == "popularity"
    assert profile.predict(2, {0: (3,), 1: (0,)}) == [(2, 0.5), (0, 0.25), (3, 0.25), (1, 0.0)]
    # second MoE layer: only l-1; first: popularity; missing history: popularity
    assert profile.source(1, {0: (0,)}) == "l-1"
    assert profile.source(0, {}) == "popularity"
    assert profile.source(2, {}) == "popularity"


def test_predict_deterministic_chain_and_quality():
    profile = RoutingProfile([0, 1, 2, 3], num_experts=4, top_k=1)
    for routing in chain_tokens(40):
        profile.add_token(routing)
    for routing in chain_tokens(4):
        history = {}
        for l in (0, 1, 2, 3):
            ranked = profile.predict(l, history)
            assert len(ranked) == 4 and sum(p for _, p in ranked) == pytest.approx(1.0)
            if l:
                assert ranked[0] == (routing[l][0], 1.0)
            history[l] = routing[l]
    # layer 0 (popularity) is right 1 time in 4; layers 1-3 always: 13/16
    quality = predictor_quality(profile, chain_tokens(4), k=1)
    assert quality == {"precision": 13 / 16, "recall": 13 / 16}
    wide = predictor_quality(profile, chain_tokens(4), k=4)
    assert wide["recall"] == 1.0 and wide["precision"] == 0.25


def test_from_trace_infers_sizes():
    records = [TraceRecord(0, t, l, [e], [1.0]) for t, routing in enumerate(chain_tokens(8, layers=(1, 3)))
               for l, (e,) in routing.items()]
    profile = RoutingProfile.from_trace(records, min_count=1)
    assert (profile.moe_layers, profile.num_experts, profile.top_k) == ([1, 3], 4, 1)
    assert profile.predict(3, {1: (2,)})[0] == (3, 1.0)


def test_add_token_validates():
    profile = RoutingProfile([0, 1], num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="layer 2 is not a MoE layer"):
        profile.add_token({2: (0, 1)})
    with pytest.raises(ValueError, match="expected 2 distinct"):
        profile.add_token({0: (1,)})
    with pytest.raises(ValueError, match="outside 0..3"):
        profile.add_token({0: (1, 4)})


# ---- temporal statistics ----------------------------------------------------------------------------
def test_temporal_counts_and_reuse_by_hand():
    profile = RoutingProfile([0], num_experts=3, top_k=1, min_count=2)
    for first, second in ((0, 0), (0, 1), (1, 1), (2, 0)):
        profile.add_pair({0: (first,)}, {0: (second,)})
    assert profile.pairs[0] == 4 and profile.before[0] == [2, 1, 1]
    assert profile.after[0] == [2, 2, 0] and profile.both[0] == [1, 1, 0]
    assert profile.reuse(0, 0, used=True) == 0.5            # stay: 0 then 0, of 2 pairs starting at 0
    assert profile.reuse(0, 0, used=False) == 0.5           # arrive: (2, 0), of 2 pairs not starting at 0
    assert profile.reuse(0, 1, used=False) == 1 / 3         # (0, 1) of 3 pairs not starting at 1
    # expert 1 started 1 pair (< min_count 2): stay backs off to A * popularity, no token counted: 0
    assert profile.reuse(0, 1, used=True) == 0.0
    profile.add_token({0: (1,)})
    profile.add_token({0: (2,)})
    assert profile.reuse(0, 1, used=True) == 0.5            # 1 * popularity[0][1] = 1/2


def test_from_trace_pairs_only_consecutive_positions_of_one_sequence():
    records = [TraceRecord(0, 0, 0, [1], [1.0]), TraceRecord(0, 1, 0, [1], [1.0]),
               TraceRecord(0, 3, 0, [1], [1.0]),                     # position 2 missing: no pair (1, 3)
               TraceRecord("b", 4, 0, [0], [1.0]), TraceRecord("b", 5, 0, [1], [1.0])]
    profile = RoutingProfile.from_trace(records, num_experts=2)
    assert profile.pairs[0] == 2 and profile.before[0] == [1, 1] and profile.both[0] == [0, 1]


def test_a_profile_saved_without_temporal_counts_still_loads(tmp_path):
    profile = RoutingProfile([0, 1], num_experts=4, top_k=2, min_count=1)
    for t in range(6):
        profile.add_token({0: (t % 4, (t + 1) % 4), 1: (0, 3)})
        profile.add_pair({0: (t % 4, (t + 1) % 4), 1: (0, 3)}, {0: ((t + 1) % 4, (t + 2) % 4), 1: (0, 3)})
    old = profile.to_json()
    del old["temporal"]
    loaded = RoutingProfile.from_json(old)
    assert loaded.reuse(1, 0, used=True) == 1.0 and loaded.reuse(1, 1, used=False) == 0.0   # 2 * popularity
    assert RoutingProfile.from_json(profile.to_json()).reuse(0, 1, used=True) == profile.reuse(0, 1, used=True)
    bad = profile.to_json()
    bad["temporal"]["0"]["before"] = [1]
    (tmp_path / "profile.json").write_text(json.dumps({"routing": bad}))
    with pytest.raises(StoreError, match="malformed 'routing'.*temporal"):
        load_routing_profile(tmp_path)


# ---- persistence ------------------------------------------------------------------------------------
def test_profile_json_round_trip_preserves_other_sections(tmp_path):
    profile = RoutingProfile([0, 1, 2], num_experts=5, top_k=2, min_count=1)
    for t in range(10):
        profile.add_token({0: (t % 5, (t + 1) % 5), 1: ((t + 2) % 5, t % 5), 2: ((t * 3) % 5, (t * 3 + 1) % 5)})
    (tmp_path / "profile.json").write_text(json.dumps({"latency": {"cpu_fused": [1.0, 2.0]}, "popularity": {}}))
    save_routing_profile(tmp_path, profile)
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["latency"] == {"cpu_fused": [1.0, 2.0]}
    assert data["popularity"] == {str(l): row for l, row in profile.popularity.items()}
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]     # no temp file left
    loaded = load_routing_profile(tmp_path)
    assert loaded.to_json() == profile.to_json()
    history = {0: (1, 2), 1: (3, 1)}
    assert loaded.predict(2, history) == profile.predict(2, history)


def test_saved_popularity_is_what_the_store_reads(tiny_model, tmp_path):
    store_dir = tmp_path / "store"
    convert(tiny_model("mixtral"), store_dir, bits=4)
    profile = RoutingProfile([0, 1], num_experts=4, top_k=2)
    profile.add_token({0: (2, 1), 1: (0, 3)})
    profile.add_token({0: (2, 0), 1: (3, 1)})
    save_routing_profile(store_dir, profile)
    with open_store(store_dir, place_popular=False) as store:
        assert store.popularity == {(l, e): p for l, row in profile.popularity.items() for e, p in enumerate(row)}
        assert store.popularity[(0, 2)] == 0.5 and store.popularity[(1, 3)] == 0.5


def test_load_errors(tmp_path):
    with pytest.raises(StoreError, match="no profile"):
        load_routing_profile(tmp_path)
    (tmp_path / "profile.json").write_text('{"latency": {}}')
    with pytest.raises(StoreError, match="no 'routing' section"):
        load_routing_profile(tmp_path)
    (tmp_path / "profile.json").write_text('{"routing": {"version": 1}}')
    with pytest.raises(StoreError, match="malformed 'routing'"):
        load_routing_profile(tmp_path)


# ---- recording --------------------------------------------------------------------------------------
def test_trace_recorder_matches_router(tiny_model):
    model = edgemoe.load(tiny_model("mixtral"))
    ids = torch.tensor([5, 17, 42, 9, 100, 3])
    hidden = {}                                  # layer -> the router's input, captured beside the recorder
    model.add_moe_input_hook(lambda l, x: hidden.__setitem__(l, x.clone()))
    with TraceRecorder(model) as rec:
        model.logits(ids)
    assert model.routing_hooks == []
    moe = model.spec.moe_layer_ids
    assert len(rec.records) == len(ids) * len(moe)
    assert {(r.seq, r.token, r.layer) for r in rec.records} == {(0, t, l) for t in range(len(ids)) for l in moe}
    for r in rec.records:
        w = model.layers[r.layer]
        weights, experts = route(hidden[r.layer], w["router"], model.spec.top_k, model.spec.norm_topk_prob)
        assert r.experts == experts[r.token].tolist()
        assert len(r.experts) == model.spec.top_k and sum(r.weights) == pytest.approx(1.0)  # Mixtral renormalises


def test_trace_recorder_continues_positions_with_label(tiny_model):
    model = edgemoe.load(tiny_model("mixtral"))
    cache = model.new_cache()
    with TraceRecorder(model, seq="doc") as rec:
        model.logits([5, 6, 7], cache)
        model.logits([8], cache)
    tokens = tokens_from_trace(rec.records)
    assert len(tokens) == 4 and {r.token for r in rec.records} == {0, 1, 2, 3}
    assert {r.seq for r in rec.records} == {"doc"}


def test_trace_recorder_segments_keep_their_sequence(tiny_model):
    """Two sequences in one step, then only the second: it stays seq 1 (told apart by its cache)."""
    model = edgemoe.load(tiny_model("mixtral"))
    first, second = model.new_cache(), model.new_cache()
    with TraceRecorder(model) as rec:
        model.forward(torch.tensor([5, 6, 7, 8, 9]), [Segment(first, 2), Segment(second, 3)])
        model.forward(torch.tensor([10]), [Segment(second, 1)])
    layer = model.spec.moe_layer_ids[0]
    seen = [(r.seq, r.token) for r in rec.records if r.layer == layer]
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]


def test_convert_profiles_at_most_profile_tokens_of_the_calibration_text(tiny_model, tmp_path):
    """--profile-tokens caps the tokens traced for profile.json: each MoE layer counts top_k choices
    per profiled token; the default (PROFILE_TOKENS) covers a text shorter than it whole."""
    checkpoint = tiny_model("mixtral")
    text = "To be, or not to be, that is the question. " * 12
    model = edgemoe.load(checkpoint)
    tokens = len(model.tokenizer.encode(text, add_special_tokens=False))
    assert tokens > 50
    for cap, expected in ((50, 50), (None, tokens)):
        out = tmp_path / f"cap-{cap}"
        convert(checkpoint, out, bits=4, calib_text=text, **({} if cap is None else {"profile_tokens": cap}))
        profile = load_routing_profile(out)
        assert {sum(c) for c in profile.counts.values()} == {expected * model.spec.top_k}


def test_profile_tokens_needs_calibration_text(tiny_model, tmp_path, monkeypatch, capsys):
    from helpers import run_cli

    code, err = run_cli(monkeypatch, capsys, "convert", str(tiny_model("mixtral")), "-o", str(tmp_path / "s"),
                        "--profile-tokens", "100")
    assert code == 2 and err.startswith("error: --profile-tokens: only with --calib") and "\n" not in err
    assert not (tmp_path / "s").exists()


def test_a_convert_writes_the_same_store_twice(tiny_model, tmp_path):
    """Two converts of one checkpoint with calibration text, in fresh processes with different hash
    seeds, write byte-identical stores, profile.json included. They share the machine's latency
    calibration, as two converts on one machine do (the cache directory): the compute path of each
    expert is chosen by it, and paths round differently (docs/budget.md, "Reproducible on one machine")."""
    import os
    import subprocess
    import sys

    checkpoint = tiny_model("qwen3_moe", num_hidden_layers=4, num_experts=6)
    text = tmp_path / "calib.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 40)
    stores = [tmp_path / f"store-{seed}" for seed in (1, 2)]
    for seed, out in zip((1, 2), stores):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        subprocess.run([sys.executable, "-m", "edgemoe", "convert", str(checkpoint), "--out", str(out), "--bits", "4",
                        "--calib", str(text), "--threads", "2"], env=env, check=True, capture_output=True)
    names = sorted(p.name for p in stores[0].iterdir())
    assert "profile.json" in names and names == sorted(p.name for p in stores[1].iterdir())
    assert [n for n in names if (stores[0] / n).read_bytes() != (stores[1] / n).read_bytes()] == []


def test_remembered_predictions_follow_the_counts_and_are_the_callers_to_change():
    """predict remembers its answers per table row: counting more tokens answers anew, and a caller
    changing the list it got changes nothing the next caller gets."""
    profile = RoutingProfile([0, 1], num_experts=4, top_k=1, min_count=1)
    profile.add_token({0: (0,), 1: (1,)})
    first = profile.predict(1, {0: (0,)})
    assert first[0] == (1, 1.0)
    first.clear()
    assert profile.predict(1, {0: (0,)})[0] == (1, 1.0)
    for _ in range(3):
        profile.add_token({0: (0,), 1: (2,)})
    assert profile.predict(1, {0: (0,)})[0] == (2, 0.75)
    assert profile.predict(1, {0: (3,)}) == profile.predict(1, {})   # unseen history: popularity, either way
