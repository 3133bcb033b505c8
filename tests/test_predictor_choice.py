"""The predictor chosen by measurement: correlation table against gate look-ahead, scored on the half of
the text the table was not built from, recorded in profile.json when a store is profiled, and used by
preload="auto"; stores profiled before (or from a trace) keep the old rule."""

import json
import random
import shutil

import pytest
import torch

import edgemoe
from edgemoe.convert import convert
from edgemoe.scheduling.predictor_choice import compare_predictors
from edgemoe.scheduling.preload import auto_predictor, next_moe_layers
from edgemoe.scheduling.profile import TraceRecord, write_trace
from edgemoe.store.format import StoreError
from edgemoe.store.profile_file import read_predictor_choice
from edgemoe.tracing import LookaheadRecorder, profile_store

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds "
        "that lour'd upon our house in the deep bosom of the ocean buried. ") * 4


def two_layer_trace(n: int, shift, seed: int = 0) -> list[TraceRecord]:
    """Top-1, 4 experts: layer 0 random, layer 1 = layer 0 + shift(t) (mod 4)."""
    rng, records = random.Random(seed), []
    for t in range(n):
        first = rng.randrange(4)
        records += [TraceRecord(0, t, 0, [first], [1.0]), TraceRecord(0, t, 1, [(first + shift(t)) % 4], [1.0])]
    return records


def guesses(records, guess) -> list[TraceRecord]:
    """A look-ahead trace guessing layer 1 as guess(actual expert)."""
    return [TraceRecord(r.seq, r.token, 1, [guess(r.experts[0])], [1.0]) for r in records if r.layer == 1]


def test_the_better_predictor_wins_on_the_half_the_table_did_not_see():
    records = two_layer_trace(200, lambda t: 1)
    right, wrong = guesses(records, lambda e: e), guesses(records, lambda e: (e + 2) % 4)
    chosen = compare_predictors(records, wrong, [0, 1], 4, 1)
    assert chosen == {"predictor": "correlation", "precision": {"correlation": 1.0, "lookahead": 0.0},
                      "predictions": 100}
    assert compare_predictors(records, right, [0, 1], 4, 1)["predictor"] == "correlation"   # a tie: the table
    # The routing changes between the halves: a table that had seen the scored half would be right.
    changed = two_layer_trace(200, lambda t: 1 if t < 100 else 2)
    chosen = compare_predictors(changed, guesses(changed, lambda e: e), [0, 1], 4, 1)
    assert chosen["predictor"] == "lookahead" and chosen["precision"] == {"correlation": 0.0, "lookahead": 1.0}


def test_nothing_to_score_gives_no_choice():
    records = two_layer_trace(1, lambda t: 1)
    assert compare_predictors(records, guesses(records, lambda e: e), [0, 1], 4, 1) is None
    records = two_layer_trace(10, lambda t: 1)
    assert compare_predictors(records, [], [0, 1], 4, 1) is None


def test_auto_uses_the_recorded_choice_else_the_old_rule():
    assert auto_predictor(object(), "lookahead") == "lookahead"
    assert auto_predictor(object(), "correlation") == "correlation"
    assert auto_predictor(object(), None) == "correlation"            # profiled before the measurement
    assert auto_predictor(None, None) == "lookahead"                  # no profile
    assert auto_predictor(None, "correlation") == "lookahead"         # a choice without its table


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("choice") / "store"
    convert(tiny_model("qwen3_moe", num_hidden_layers=4, num_experts=6), out, bits=4, calib_text=TEXT)
    return out


def test_the_look_ahead_trace_is_the_next_layers_router_on_this_layers_input(store):
    model = edgemoe.load(store, preload="none")
    nxt = next_moe_layers(model.spec)
    inputs = {}
    model.moe_input_hooks.append(lambda layer, x: inputs.__setitem__(layer, x.clone()))
    ids = torch.tensor(model.tokenizer.encode(TEXT, add_special_tokens=False)[:12])
    with LookaheadRecorder(model, seq="s") as recorder:
        model.logits(ids)
    assert {r.layer for r in recorder.records} == set(nxt.values())
    for before, layer in nxt.items():
        _, expected = model.route(layer, inputs[before])
        got = [r.experts for r in recorder.records if r.layer == layer]
        assert got == expected.tolist() and [r.token for r in recorder.records if r.layer == layer] == list(range(12))


def test_profiling_records_the_measured_choice_and_auto_follows_it(store, tmp_path):
    profile_store(store, TEXT * 3)
    section = json.loads((store / "profile.json").read_text())["predictor"]
    assert section["predictor"] in ("correlation", "lookahead") and section["predictions"] > 0
    assert all(0.0 <= p <= 1.0 for p in section["precision"].values())
    better = max(section["precision"], key=section["precision"].get)
    assert section["predictor"] == better or len(set(section["precision"].values())) == 1
    with edgemoe.load(store) as model:
        assert model.preloader.predictor == section["predictor"] == read_predictor_choice(store)
    # A profile from a trace has no hidden states to look ahead from: the choice is dropped, and the
    # store predicts as one profiled before the measurement existed.
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, [TraceRecord(0, t, l, [t % 6, (t + l + 1) % 6], [0.5, 0.5]) for t in range(20) for l in range(4)])
    profile_store(store, trace=trace)
    assert "predictor" not in json.loads((store / "profile.json").read_text())
    with edgemoe.load(store) as model:
        assert model.preloader.predictor == "correlation"


def test_a_malformed_choice_is_refused_when_the_store_opens_naming_the_file_and_field(store, tmp_path):
    broken = tmp_path / "store"
    shutil.copytree(store, broken)
    data = json.loads((broken / "profile.json").read_text())
    data["predictor"] = {"predictor": "oracle"}
    (broken / "profile.json").write_text(json.dumps(data))
    with pytest.raises(StoreError, match=r"profile.json: malformed 'predictor' section: 'predictor' is 'oracle'"):
        edgemoe.load(broken)
