"""One kernel call for a layer's experts (StoreExperts with layer_kernel, the default) against one
call per expert (layer_kernel=False, the per-expert path): the same logits bit for bit, in decode
and in a prefill, with bfloat16 or float32 dense weights, with every expert resident or a cache
that holds one expert (misses computed after the resident ones), on a store of mixed widths. One
thread: torch's products (the dense layers') may round differently at another thread count."""

import json

import numpy as np
import pytest
import torch

import edgemoe
from edgemoe.convert import convert, read_widths
from edgemoe import quantized
from edgemoe.kernels.cpu_int import G_BITS
from edgemoe.kernels.ops import INT_PATH_ENV, int_paths
from edgemoe.store import read_manifest

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


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_store_holding_every_expert_serves_a_layer_from_its_table_alike(mixed_store, monkeypatch, path, dtype):
    """Every expert resident in RAM: a step's layer finds its experts' rows in the store's layer
    table (no object per expert), with the general path's logits bit for bit and its request counts,
    on each integer path this CPU runs (forced) and with bfloat16 dense weights."""
    monkeypatch.setenv(INT_PATH_ENV, path)

    def run(use_table):
        with edgemoe.load(mixed_store, dtype, 1, preload="none", compute="fused-int") as model:
            store = model.store
            for entry in store.experts():
                store.get(*entry.key)
            tables = []
            table = store.resident_layer_table
            monkeypatch.setattr(store, "resident_layer_table",
                                lambda l: tables.append(l) or (table(l) if use_table else None))
            served = []
            resident = model.experts._run_resident
            monkeypatch.setattr(model.experts, "_run_resident", lambda *a: served.append(resident(*a)) or served[-1])
            out = decode(model, IDS), model.logits(IDS)
            hits = store.stats.ram.hits
        return out, hits, tables, served
    (with_table, hits, tables, served), (without, hits_without, _, unused) = run(True), run(False)
    assert torch.equal(with_table[0], without[0]) and torch.equal(with_table[1], without[1])
    assert hits == hits_without
    assert tables and served and all(out is not None for out in served)
    assert all(out is None for out in unused)   # without the table: the general path each time


def test_the_layer_table_appears_at_the_placement_that_makes_every_expert_resident(mixed_store):
    from edgemoe.store import TieredStore
    with TieredStore(mixed_store) as store:
        layer = store.spec.moe_layer_ids[0]
        *first, last = store.experts()
        for entry in first:
            store.get(*entry.key)
        assert store.resident_layer_table(layer) is None            # one expert still on disk
        store.get(*last.key)                                        # the placement drops that answer
        table = store.resident_layer_table(layer)
        rows = [store.get(layer, e).layout for e in range(store.spec.num_experts)]
        assert table is not None and (table == np.stack(rows)).all()
        assert len(set(table[:, G_BITS].tolist())) == 3              # each expert's row at its own width
    entry = max(e.length for e in read_manifest(mixed_store).experts.values())
    with TieredStore(mixed_store, ram=2 * entry) as small:
        for e in range(small.spec.num_experts):
            small.get(layer, e)
        assert small.resident_layer_table(layer) is None           # a cache that cannot hold them all
