"""Adaptive top-k (--skip-below): a non-resident expert that every token chose weakly is not read and
the token's other weights are rescaled; checked against the same store with the routing changed
by hand, and never applied to resident experts nor to a token's strongest choice."""

import pytest
import torch

import edgemoe
from edgemoe.convert import convert
from helpers import decode, decode_all_resident


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("skip") / "store"
    convert(tiny_model("mixtral"), out, bits=4)
    return out


def dropping_weak(model, threshold):
    """The model's router with every non-strongest choice below `threshold` dropped, weights rescaled."""
    plain_route = model.route

    def route(layer, x):
        weights, experts = plain_route(layer, x)
        keep = (weights >= threshold) | (weights == weights.max(dim=-1, keepdim=True).values)
        kept = weights * keep
        kept = kept * (weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True))
        return kept, experts
    return route


def test_with_nothing_resident_weak_choices_are_dropped_and_the_rest_rescaled(store):
    ids = [5, 17, 33, 2, 90, 41, 7, 64]
    skipping = edgemoe.load(store, torch.float32, preload="none", ram=0, skip_below=0.4, compute="fused-float")
    got = decode(skipping, ids)                            # one token per step: the rule is per token
    assert skipping.experts.skipped > 0
    reference = edgemoe.load(store, torch.float32, preload="none", compute="fused-float")
    reference.route = dropping_weak(reference, 0.4)
    expected = decode(reference, ids)                      # zero weights: the same sums
    assert (got - expected).abs().max() <= 1e-4


def test_resident_experts_are_never_skipped(store):
    ids = [5, 17, 33, 2, 90, 41, 7, 64]
    full = decode(edgemoe.load(store, torch.float32, preload="none"), ids)
    logits, everything = decode_all_resident(store, ids, skip_below=0.9)
    assert torch.equal(logits, full) and everything.experts.skipped == 0


def test_skipping_reads_less(store):
    ids = list(range(3, 40))
    reads = {}
    for threshold in (0.0, 0.45):
        model = edgemoe.load(store, preload="none", ram=0, skip_below=threshold)
        decode(model, ids)
        reads[threshold] = model.store.stats.disk_bytes_read
    assert reads[0.45] < reads[0.0]
