"""Scheduling: traces and profiles from the runtime, preload never changes results, the simulator
agrees with the runtime, queued predictions are cancelled when the real routing is known."""

import json
import sys
import threading

import pytest
import torch

import edgemoe
from edgemoe.store.profile_file import load_routing_profile, read_predictor_choice
from edgemoe.cli import main
from edgemoe.generate import GenerationOptions, generate_batch
from edgemoe.tracing import trace_text
from edgemoe.store import open_store, read_manifest
from edgemoe.convert import convert
from edgemoe.scheduling import simulate as sim
from edgemoe.scheduling.profile import read_trace, tokens_from_trace
from edgemoe.tracing import TraceRecorder


TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds "
        "that lour'd upon our house in the deep bosom of the ocean buried. ") * 4


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sched") / "store"
    convert(tiny_model("qwen3_moe", num_hidden_layers=4, num_experts=6), out, bits=4, calib_text=TEXT)   # profiled
    return out


def expert_size(store):
    return max(e.length for e in read_manifest(store).experts.values())


def test_trace_has_one_record_per_token_and_moe_layer(store):
    model = edgemoe.load(store, preload="none")
    records = trace_text(model, TEXT, context=32)
    n_tokens = len(model.tokenizer.encode(TEXT, add_special_tokens=False))
    assert len(records) == n_tokens * len(model.spec.moe_layer_ids)
    assert all(len(r.experts) == model.spec.top_k for r in records)
    assert {r.seq for r in records} == set(range(-(-n_tokens // 32)))


def test_profile_is_saved_in_the_store_and_drives_placement(store):
    profile = load_routing_profile(store)
    assert profile.moe_layers == [0, 1, 2, 3] and sum(profile.counts[0]) > 0
    data = json.loads((store / "profile.json").read_text())
    assert set(data) >= {"routing", "popularity"}
    size = expert_size(store)
    popularity = {(int(l), e): p for l, row in data["popularity"].items() for e, p in enumerate(row)}
    third = sorted(popularity.values(), reverse=True)[2]
    with open_store(store, ram=3 * size) as s:     # initial placement: 3 of the most popular experts
        resident = set(s.resident())
        # Experts as popular as the third may tie with it: any of them may take the last place.
        assert len(resident) == 3 and all(popularity[key] >= third for key in resident)
    assert edgemoe.load(store).preloader.predictor == read_predictor_choice(store) in ("correlation", "lookahead")


def greedy(model):
    prompts = [model.tokenizer.encode("Now is the winter"), model.tokenizer.encode("all the clouds")]
    return generate_batch(model, prompts, GenerationOptions(max_new_tokens=10, stop_token_ids=[]))


def test_greedy_output_is_unchanged_by_preload_and_policy(store):
    size = expert_size(store)
    expected = greedy(edgemoe.load(store, preload="none"))
    for preload in ("none", "lookahead", "correlation"):
        for policy in ("lru", "lfu", "frequency-distance", "adaptive"):
            model = edgemoe.load(store, ram=4 * size, policy=policy, preload=preload)
            assert greedy(model) == expected, (preload, policy)


@pytest.mark.parametrize("policy", ["lru", "lfu", "frequency-distance", "adaptive"])
def test_runtime_hit_rate_equals_the_simulators_on_the_same_trace(store, policy):
    n = 5
    model = edgemoe.load(store, ram=n * expert_size(store), policy=policy, preload="none", place_popular=False)
    ids = model.tokenizer.encode(TEXT, add_special_tokens=False)[:60]
    cache = model.new_cache()
    with TraceRecorder(model) as recorder:
        for token in ids:                             # decode token by token, as the simulator replays
            model.logits([token], cache)
    stats = model.store.stats
    simulated = sim.simulate(tokens_from_trace(recorder.records), n, policy,
                                     prior=load_routing_profile(store))
    assert simulated["requests"] == stats.requests
    assert simulated["hits"] == stats.ram.hits and simulated["evictions"] == stats.ram.evictions
    if policy == "adaptive":                          # it changed candidates on the way, as the simulator did
        assert model.store.cache.tiers[-1].policy.primary.changes == simulated["adaptive_changes"] != []


def test_queued_predictions_for_a_layer_are_cancelled_when_it_routes(store):
    with open_store(store, place_popular=False, readers=1) as s:
        gate, original = threading.Event(), s._read

        def slow_read(key, narrowed=False, preload=False):
            gate.wait(5)
            return original(key, narrowed, preload)

        s._read = slow_read
        s.prefetch([(0, 0)])                          # the one reader takes this one and blocks in it
        while len(s._loads):
            threading.Event().wait(0.001)
        s.prefetch([(1, 0), (1, 1), (2, 0)])
        s.prefetch([(1, 2)], urgent=True)
        s.cancel_preloads(1)                          # layer 1 routed: its predictions are moot
        assert s.stats.preloads_cancelled == 2
        gate.set()
        s.drain()
        assert set(s.resident()) == {(0, 0), (1, 2), (2, 0)}


def test_preload_budget_is_paid_by_the_disks_idle_time(store):
    model = edgemoe.load(store, preload="correlation", place_popular=False)
    preloader, disk = model.preloader, model.store.disk
    assert preloader.affordable_reads(tokens=1) == model.spec.top_k          # nothing measured yet
    disk.reads, disk.read_seconds = 10, 10 * 0.004                 # 4 ms per expert read
    preloader.idle_seconds = 0.0                                   # disk-bound: never idle, no preload
    assert [preloader.affordable_reads(tokens=3) for _ in range(3)] == [0, 0, 0]
    preloader.idle_seconds = 0.003                                 # a read's worth every 4/3 layers
    assert [preloader.affordable_reads(tokens=3) for _ in range(4)] == [0, 1, 2, 3]
    assert [preloader.affordable_reads(tokens=1) for _ in range(2)] == [2, 2]  # the credit is capped at top-k
    sure = [0.9, 0.8, 0.7, 0.4, 0.0, 0.0]
    preloader._issue(1, sure, preloader.affordable_reads(1), least=0.5)   # spends the 2 it has: two reads
    assert preloader._predicted[1] == {0, 1} and preloader.credit == pytest.approx(0.0)
    model.store.drain()
    disk.reads, disk.read_seconds = 10, 10 * 0.004
    preloader.credit = 3.0
    preloader._issue(1, sure, preloader.affordable_reads(3), least=0.5)   # resident ones and p < 0.5 skipped
    assert preloader._predicted[1] == {2} and preloader.credit == pytest.approx(2.0 + 0.75)
    with pytest.raises(ValueError, match="preload='nope'"):
        edgemoe.load(store, preload="nope")


def test_trace_and_profile_commands(store, tmp_path, monkeypatch, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setattr(sys, "argv", ["edgemoe", "trace", str(store), "--text", str(text), "-o", str(trace)])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 0 and len(read_trace(trace)) > 0
    monkeypatch.setattr(sys, "argv", ["edgemoe", "profile", str(store), "--trace", str(trace), "--force"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 0 and "profiled" in capsys.readouterr().out


def test_predictions_wait_while_the_running_layer_waits_for_the_disk():
    from edgemoe.store.loads import LoadQueue
    q = LoadQueue(capacity=8)
    q.put((2, 0), urgent=False)
    q.await_layer([(0, 0), (0, 1)])                   # layer 0 began without two of its experts
    q.put((0, 1), urgent=True)
    assert q.get() == ((0, 1), True)                  # the running layer's reads go first
    got = []
    reader = threading.Thread(target=lambda: got.append(q.get()))
    reader.start()
    reader.join(0.1)
    assert got == []                                  # (0, 0) is still awaited: the disk is not free
    q.arrived([(0, 1)])
    q.arrived([(0, 0)])
    reader.join(5)
    assert got == [((2, 0), False)]
    for e in range(8):
        assert q.put((3, e), urgent=False)
    assert not q.put((4, 0), urgent=True) and len(q) == 8   # full: best effort, nothing queued


def test_the_next_layer_releases_held_predictions_when_it_needs_no_read():
    from edgemoe.store.loads import LoadQueue
    q = LoadQueue(capacity=8)
    q.await_layer([(0, 0)])                           # layer 0 waits for the disk
    q.put((2, 0), urgent=False)
    got = []
    reader = threading.Thread(target=lambda: got.append(q.get()))
    reader.start()
    reader.join(0.1)
    assert got == []
    q.await_layer([])                                 # layer 1 has everything resident: the disk is free
    reader.join(5)
    assert got == [((2, 0), False)]


def test_a_preload_starts_only_after_the_running_layers_reads(store):
    with open_store(store, place_popular=False) as s:
        s.begin_layer(0, needed=[(0, 0)])
        s.prefetch([(2, 0)])
        threading.Event().wait(0.1)
        assert s.resident() == {}                     # held while layer 0 waits for (0, 0)
        s.get(0, 0)
        s.drain()
        assert set(s.resident()) == {(0, 0), (2, 0)}


def test_lookahead_predicts_with_the_next_layers_own_router(tiny_model, tmp_path):
    """DeepSeek-V3 picks experts by biased sigmoid scores within the best groups, not by softmax top-k:
    the lookahead's predictions are those of transformers' own router on the same hidden states."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    checkpoint = tiny_model("deepseek_v3")
    convert(checkpoint, tmp_path / "s", bits=8)
    model = edgemoe.load(tmp_path / "s", preload="lookahead", place_popular=False)
    router = DeepseekV3TopkRouter(AutoConfig.from_pretrained(checkpoint))
    nxt = model.spec.moe_layer_ids[1]
    router.weight.data.copy_(model.layers[nxt]["router"])
    router.e_score_correction_bias.copy_(model.layers[nxt]["router_bias"])
    first = model.spec.moe_layer_ids[0]
    seen, issued = [], []
    model.add_moe_input_hook(lambda layer, x: layer == first and seen.append(x.clone()))
    model.preloader._issue = lambda layer, scores, tokens, **kw: issued.append((layer, scores))
    # How many preloads a step affords follows the measured disk idle time: none on a slow step
    # (seen on a 2-core machine). What is predicted is this test's question, so every step affords.
    model.preloader._affordable = lambda tokens: model.spec.num_experts
    cache = model.new_cache()
    for token in model.tokenizer.encode(TEXT, add_special_tokens=False)[:8]:   # one token per step: top-2 of 8
        model.logits([token], cache)
    assert len(issued) == len(seen) == 8
    for (layer, scores), x in zip(issued, seen):
        with torch.inference_mode():
            _, _, expected = router(x)
        assert layer == nxt and {e for e, score in enumerate(scores) if score} == set(expected.flatten().tolist())


@pytest.mark.parametrize("predictor", ["lookahead", "correlation"])
def test_a_store_held_whole_in_ram_predicts_nothing(store, predictor):
    with edgemoe.load(store, preload=predictor, compute="fused-float", place_popular=False) as model:
        ids = torch.tensor([3, 4, 5, 6])
        model.logits(ids)
        assert model.preloader.actual > 0                  # experts still missing: the preloader works
        for entry in model.store.experts():
            model.store.get(*entry.key)
        assert model.store.holds_everything()
        actual, issued = model.preloader.actual, model.store.stats.preloads_issued
        model.logits(ids)
        assert (model.preloader.actual, model.store.stats.preloads_issued) == (actual, issued)


def instrument_reads(s, before_read):
    """Make s.disk.read call before_read(entry, preload) first, and log the keys whose reads finished."""
    finished, original = [], s.disk.read

    def read(entry, pause=None):
        before_read(entry, pause)
        blob = original(entry) if pause is None else original(entry, pause)
        finished.append(entry.key)
        return blob

    s.disk.read = read
    return finished


def test_no_preload_starts_while_a_caller_reads_an_expert_it_needs(store):
    with open_store(store, place_popular=False, readers=1) as s:
        demand_reading, go_on, preload_started = threading.Event(), threading.Event(), threading.Event()

        def before_read(entry, pause):
            if entry.key == (0, 0):
                demand_reading.set()
                go_on.wait(5)
            else:
                preload_started.set()

        finished = instrument_reads(s, before_read)
        caller = threading.Thread(target=s.get, args=(0, 0))
        caller.start()
        assert demand_reading.wait(5)
        s.prefetch([(2, 0)])                          # queued while the caller's read is under way
        assert not preload_started.wait(0.5)          # held (given the time to start, it does not)
        go_on.set()
        caller.join(5)
        s.drain()
        assert finished == [(0, 0), (2, 0)]


def test_a_preload_under_way_pauses_between_its_chunks_while_a_caller_waits(store, monkeypatch):
    from edgemoe.store import disk
    monkeypatch.setattr(disk, "CHUNK", 4096)          # the tiny experts in several chunks
    with open_store(store, place_popular=False, readers=1) as s:
        preload_under_way, demand_reading = threading.Event(), threading.Event()
        finished, original = [], s.disk.read

        def read(entry, pause=None):
            if pause is None:                          # the caller's read
                demand_reading.set()
            elif not preload_under_way.is_set():
                store_pause = pause

                def pause():                           # the preload's first pause: once the caller reads,
                    preload_under_way.set()            # pause as the store says
                    demand_reading.wait(5)
                    store_pause()
            blob = original(entry) if pause is None else original(entry, pause)
            finished.append(entry.key)
            return blob

        s.disk.read = read
        s.prefetch([(2, 0)])
        assert preload_under_way.wait(5)              # its first chunk is read
        s.get(0, 0)                                   # demand arrives while the preload is under way
        s.drain()
        assert finished == [(0, 0), (2, 0)]           # the preload waited; it was not cancelled
        assert set(s.resident()) == {(0, 0), (2, 0)}


def test_a_layers_misses_are_read_several_at_once(store):
    readers = 3
    with open_store(store, place_popular=False, readers=readers) as s:
        all_in_flight = threading.Barrier(readers, timeout=5)
        instrument_reads(s, lambda entry, pause: all_in_flight.wait())   # passes only with `readers` in flight
        s.begin_layer(1, needed=[(1, e) for e in range(readers)])
        s.prefetch([(1, e) for e in range(readers)], urgent=True)
        s.drain()
        assert not all_in_flight.broken and set(s.resident()) == {(1, e) for e in range(readers)}


def test_demand_reads_go_before_preloads_queued_earlier(store):
    with open_store(store, place_popular=False, readers=1) as s:
        gate = threading.Event()
        finished = instrument_reads(s, lambda entry, pause: gate.wait(5) if entry.key == (3, 0) else None)
        s.prefetch([(3, 0)])                          # the one reader is held in this preload
        while len(s._loads):
            threading.Event().wait(0.001)
        s.prefetch([(3, 1), (3, 2)])                  # preloads queued first
        s.begin_layer(1, needed=[(1, 0), (1, 1)])
        s.prefetch([(1, 0), (1, 1)], urgent=True)     # then the running layer's misses
        gate.set()
        s.get(1, 0), s.get(1, 1)
        s.drain()
        assert set(finished[:3]) == {(3, 0), (1, 0), (1, 1)}   # the preload under way is not cancelled
        assert finished[3:] == [(3, 1), (3, 2)]


def test_nothing_is_predicted_while_the_guard_has_preloading_off(store, monkeypatch):
    with edgemoe.load(store, preload="correlation", ram="50%", place_popular=False) as model:
        predictions = []
        monkeypatch.setattr(model.preloader.profile, "predict", lambda *a: predictions.append(a) or [])
        model.store.guard.level = 1                   # "no-preload": predicting would only cost time
        model.store.guard.probe_every = model.store.guard._probe_gap = 10**6
        greedy(model)
        assert predictions == [] and model.store.stats.preloads_loaded == 0
        model.store.guard.level = 0
        greedy(model)
        assert predictions                            # the same model predicts once preloads may go


def test_the_reader_count_comes_from_the_option_else_the_environment(store, monkeypatch):
    from edgemoe.options import OptionError
    from edgemoe.store.loads import READERS, reader_count
    monkeypatch.delenv("EDGEMOE_READERS", raising=False)
    assert reader_count(None) == READERS and reader_count(3) == 3
    monkeypatch.setenv("EDGEMOE_READERS", "4")
    assert reader_count(None) == 4 and reader_count(1) == 1
    with open_store(store, place_popular=False) as s:
        assert s.readers == 4 and len(s._loaders) == 4
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("EDGEMOE_READERS", bad)
        with pytest.raises(OptionError, match=f"EDGEMOE_READERS.*{bad}"):
            reader_count(None)
    with pytest.raises(OptionError, match="readers="):
        reader_count(0)


def test_who_reads_a_layers_misses_is_chosen_by_the_wait_each_way_measured():
    from edgemoe.store.loads import ReadChoice
    choice = ReadChoice(window_layers=2, probe_every=4)

    def window(wait_per_byte):
        for _ in range(2):
            choice.observe_layer(wait_per_byte * 100, 100)

    assert choice.submit                               # the readers first
    window(0.002)
    assert not choice.submit                           # then the caller's own reads, to time them too
    window(0.001)                                      # the caller waited less per byte: keep it
    assert not choice.submit and choice.seconds_per_byte == {True: 0.002, False: 0.001}
    window(0.001), window(0.001)
    assert choice.submit                               # every 4th window the other way is timed again
    window(0.004)
    assert not choice.submit                           # still slower: back to the caller's reads
    choice.observe_layer(0.0, 0), choice.observe_layer(0.0, 0)   # nothing read: nothing learnt
    assert not choice.submit and choice.seconds_per_byte[False] == 0.001


def test_urgent_reads_are_left_to_the_caller_where_its_reads_measured_faster(store):
    with open_store(store, place_popular=False) as s:
        s.read_choice.submit = False
        s.begin_layer(1, needed=[(1, 0), (1, 1)])
        s.prefetch([(1, 0), (1, 1)], urgent=True)
        assert len(s._loads) == 0 and s.resident() == {}   # nothing queued: get() reads each
        s.get(1, 0)
        assert set(s.resident()) == {(1, 0)}


def test_a_paused_preload_goes_on_once_the_caller_has_what_it_waited_for(store, monkeypatch):
    """All readers paused in preloads, the running layer's urgent reads still queued: the caller
    reads them itself, and the preloads then finish (a drain returns) rather than wait for a reader."""
    from edgemoe.store import disk
    monkeypatch.setattr(disk, "CHUNK", 4096)
    with open_store(store, place_popular=False, readers=1) as s:
        held, go_on, original = threading.Event(), threading.Event(), s.disk.read

        def read(entry, pause=None):
            if pause is not None and not held.is_set():
                store_pause = pause

                def pause():                          # the preload's first pause waits for the layer below
                    held.set()
                    go_on.wait(5)
                    store_pause()
            return original(entry) if pause is None else original(entry, pause)

        s.disk.read = read
        s.prefetch([(2, 0)])
        assert held.wait(5)                           # the one reader is in the preload
        s.begin_layer(1, needed=[(1, 0)])
        s.prefetch([(1, 0)], urgent=True)             # queued: no reader is free
        go_on.set()                                   # the preload pauses: layer 1 awaits (1, 0)
        s.get(1, 0)                                   # the caller reads it itself
        drain = threading.Thread(target=s.drain, daemon=True)
        drain.start()
        drain.join(5)
        assert not drain.is_alive() and set(s.resident()) == {(1, 0), (2, 0)}
