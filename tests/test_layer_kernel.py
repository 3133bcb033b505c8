"""One kernel call for a layer's experts (StoreExperts with layer_kernel, the default) against one
call per expert (layer_kernel=False, the per-expert path): the same logits bit for bit, in decode
and in a prefill, with bfloat16 or float32 dense weights, with every expert resident or a cache
that holds one expert (misses computed after the resident ones), on a store of mixed widths. One
thread: torch's products (the dense layers') may round differently at another thread count."""

import json

import pytest
import torch

import edgemoe
from edgemoe.convert import convert, read_widths
from edgemoe import quantized

from helpers import decode

IDS = list(range(3, 27))


@pytest.fixture(scope="module")
def mixed_store(tiny_model, tmp_path_factory):
    checkpoint = tiny_model("qwen2_moe", num_hidden_layers=3, num_experts=6, mlp_only_layers=[1])
    spec = edgemoe.load(checkpoint).spec
    tmp = tmp_path_factory.mktemp("layer-kernel")
    widths = {str(l): [(2, 4, 8)[(l + e) % 3] for e in range(spec.num_experts)] for l in spec.moe_layer_ids}
    (tmp / "w.json").write_text(json.dumps({"widths": widths}))
    convert(checkpoint, tmp / "mixed", widths=read_widths(tmp / "w.json", spec))
    return tmp / "mixed"


def logits(store, layer_kernel, dtype, **options):
    with edgemoe.load(store, dtype, 1, preload="none", compute="fused-int", **options) as model:
        model.experts.layer_kernel = layer_kernel
        return decode(model, IDS), model.logits(IDS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ram", [None, "1B"])
def test_the_layer_kernel_gives_the_per_expert_paths_logits_bit_for_bit(mixed_store, dtype, ram, monkeypatch):
    calls = []
    kernel = quantized.swiglu_experts_int
    monkeypatch.setattr(quantized, "swiglu_experts_int", lambda *a: calls.append(len(a[1])) or kernel(*a))
    options = {} if ram is None else {"ram": ram}
    per_expert = logits(mixed_store, False, dtype, **options)
    assert not calls
    by_layer = logits(mixed_store, True, dtype, **options)
    assert torch.equal(by_layer[0], per_expert[0]) and torch.equal(by_layer[1], per_expert[1])
    assert calls and max(calls) > 1   # several experts in one call


def test_one_token_at_a_time_verification_goes_through_the_layer_kernel_alike(mixed_store):
    """Speculative verification (logits one token at a time): the layer kernel gives the per-expert
    path's bits for each token."""
    results = []
    for layer_kernel in (True, False):
        with edgemoe.load(mixed_store, torch.float32, 1, preload="none") as model:
            model.experts.layer_kernel = layer_kernel
            cache = model.new_cache()
            model.logits(IDS[:4], cache)
            results.append(model.logits(IDS[4:9], cache, one_token_at_a_time=True))
    assert torch.equal(*results)
