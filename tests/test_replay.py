"""Routing replay: a model routed by a recorded trace chooses exactly the trace's experts."""

import pytest
import torch

import edgemoe
from edgemoe.replay import RoutingReplay, records_for_model
from edgemoe.scheduling.profile import TraceRecord
from edgemoe.tracing import TraceRecorder


def test_a_model_replaying_a_trace_routes_as_the_trace_says(tiny_model):
    source = edgemoe.load(tiny_model("mixtral", num_hidden_layers=4))               # 4 MoE layers
    ids = torch.tensor(source.tokenizer.encode("Now is the winter of our discontent"))
    with TraceRecorder(source) as original:
        source.logits(ids)
    target = edgemoe.load(tiny_model("mixtral", seed=3))                           # other weights, 2 layers
    RoutingReplay(original.records, target.spec.moe_layer_ids, target.spec.num_experts,
                  target.spec.top_k).attach(target)
    cache = target.new_cache()
    with TraceRecorder(target) as replayed:
        target.logits(ids[:5], cache)                              # prefill, then decode
        for t in range(5, len(ids)):
            target.logits(ids[t:t + 1], cache)
    by_token = {(r.token, r.layer): r for r in original.records}
    for r in replayed.records:                                     # model layer i takes trace layer i
        assert r.experts == by_token[r.token, r.layer].experts
        assert r.weights == pytest.approx(by_token[r.token, r.layer].weights)
    assert len(replayed.records) == 2 * len(ids)
    # The trace as the model replays it (what a routing profile is built from) is what it replays.
    as_replayed = {(r.token, r.layer): r.experts for r in records_for_model(original.records, [0, 1])}
    assert as_replayed == {(r.token, r.layer): r.experts for r in replayed.records}


def test_a_shallower_trace_is_refused_not_repeated(tiny_model):
    source = edgemoe.load(tiny_model("mixtral"))                                   # 2 MoE layers
    with TraceRecorder(source) as original:
        source.logits([5, 6, 7])
    deeper = edgemoe.load(tiny_model("mixtral", num_hidden_layers=4))
    for build in (lambda: RoutingReplay(original.records, deeper.spec.moe_layer_ids, 4, 2, "t.jsonl"),
                  lambda: records_for_model(original.records, deeper.spec.moe_layer_ids, "t.jsonl")):
        with pytest.raises(ValueError, match="t.jsonl: 2 MoE layers for a model with 4.*make_routing_trace"):
            build()


def test_a_trace_that_does_not_fit_the_model_is_refused(tiny_model):
    model = edgemoe.load(tiny_model("mixtral"))
    records = [TraceRecord(0, 0, 0, [7, 1], [0.5, 0.5])]
    with pytest.raises(ValueError, match="t.jsonl: its routing .* does not fit a model with 4 experts"):
        RoutingReplay(records, model.spec.moe_layer_ids, model.spec.num_experts, model.spec.top_k, "t.jsonl")
    with pytest.raises(ValueError, match="empty"):
        RoutingReplay([], model.spec.moe_layer_ids, 4, 2)
