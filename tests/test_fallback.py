"""Fallback copies (convert --fallback-bits, run --fallback-below): the store keeps each wider expert
narrowed to fewer bits; a weakly chosen expert that is not resident is read and computed from that
copy. Checked against edgemoe.quant.narrow of the stored expert and a plain torch computation."""

import json
import shutil

import pytest
import torch

import edgemoe
from edgemoe.convert import convert
from edgemoe.experts import ExpertBatches
from edgemoe.options import OptionError
from edgemoe.quant import dequantize_reference, narrow
from edgemoe.quantized import StoreExperts
from edgemoe.store import StoreError, open_store, read_manifest
from edgemoe.store.format import MANIFEST
from helpers import decode, decode_all_resident


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    return tiny_model("mixtral")


@pytest.fixture(scope="module")
def store(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("fallback") / "store"
    convert(checkpoint, out, bits=4, fallback_bits=2)
    return out


def stored(store_path, layer, expert, fallback=False):
    """The expert (or its fallback copy) as the store holds it: role -> QuantizedTensor."""
    with open_store(store_path, ram=0) as s:
        return s.get(layer, expert, fallback=fallback).tensors


def test_every_wider_expert_has_its_narrowed_copy(store):
    manifest = read_manifest(store)
    assert manifest.fallback_bits == 2 and set(manifest.fallback) == set(manifest.experts)
    full, copy = stored(store, 1, 3), stored(store, 1, 3, fallback=True)
    for role, qt in full.items():
        assert copy[role].bits == 2
        assert torch.equal(dequantize_reference(copy[role]), dequantize_reference(narrow(qt, 2)))


def test_experts_already_at_the_fallback_width_have_no_copy(checkpoint, tmp_path):
    convert(checkpoint, tmp_path / "s", bits=4, widths={(0, 0): 2, (0, 1): 8}, fallback_bits=2)
    manifest = read_manifest(tmp_path / "s")
    assert set(manifest.fallback) == set(manifest.experts) - {(0, 0)}
    assert all(entry.bits == 2 for entry in manifest.fallback.values())


def test_nothing_wider_than_the_fallback_width_is_refused_before_writing(checkpoint, tmp_path):
    with pytest.raises(OptionError, match="fallback_bits=.*nothing to narrow"):
        convert(checkpoint, tmp_path / "s", bits=2, fallback_bits=2)
    assert not (tmp_path / "s").exists()


def test_fallback_below_needs_a_store_with_copies(checkpoint, tmp_path):
    convert(checkpoint, tmp_path / "plain", bits=4)
    with pytest.raises(OptionError, match=r"fallback_below=.*has no fallback copies \(convert it with --fallback-bits"):
        edgemoe.load(tmp_path / "plain", fallback_below=0.3)


def test_a_miss_reads_the_copy_and_a_strong_use_replaces_it(store):
    manifest = read_manifest(store)
    with open_store(store) as s:
        weak = s.get(0, 1, fallback=True)
        assert weak.narrowed and weak.bits == 2
        assert s.stats.disk_bytes_read == manifest.fallback[0, 1].stored_length and s.stats.fallback_reads == 1
        # the guard weighs the scheme, not the fallback: it counts the read as the expert's
        assert s.stats.full_width_bytes_read == manifest.experts[0, 1].stored_length
        assert s.get(0, 1, fallback=True) is weak                  # a resident copy serves weak uses
        strong = s.get(0, 1)                                        # the expert itself, read in full
        assert not strong.narrowed and strong.bits == 4 and s.cache.find((0, 1)) is strong
        assert s.get(0, 1, fallback=True) is strong                 # the full expert serves weak uses too
        assert s.stats.disk_bytes_read == manifest.fallback[0, 1].stored_length + manifest.experts[0, 1].stored_length


def test_an_urgent_read_replaces_a_copy_the_running_layer_needs_in_full(store):
    with open_store(store) as s:
        s.get(0, 1, fallback=True)                      # the copy is resident
        s.begin_layer(0, needed=[(0, 1)], weak=[(0, 1)])
        s.prefetch([(0, 1)], urgent=True)               # the copy will do: nothing to read
        s.drain()
        assert s.cache.find((0, 1)).narrowed and s.stats.disk_bytes_read == read_manifest(store).fallback[0, 1].stored_length
        s.begin_layer(0, needed=[(0, 1)])               # needed in full now: read in the background
        s.prefetch([(0, 1)], urgent=True)
        s.drain()
        full = s.cache.find((0, 1))
        assert not full.narrowed and s.get(0, 1) is full


def test_a_layer_computes_weak_misses_from_their_copies(store):
    """x through one MoE layer with token 0 choosing experts 2 (0.8) and 3 (0.2): the weakly chosen
    expert 3 computes from its narrowed copy, in plain torch on the dequantized weights."""
    x = torch.randn(1, read_manifest(store).spec.hidden_size, generator=torch.Generator().manual_seed(0))
    batches = ExpertBatches.from_routing(torch.tensor([[0.8, 0.2]]), torch.tensor([[2, 3]]))
    with open_store(store, ram=0) as s:
        experts = StoreExperts(s, compute="dequant", overlap=False, fallback_below=0.3)
        experts.prepare(1, batches)
        got = experts.run(1, x, batches)
        assert experts.fallback_uses == 1 and s.stats.fallback_reads == 1

    def swiglu(tensors):
        w = {role: dequantize_reference(qt) for role, qt in tensors.items()}
        return (torch.nn.functional.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T

    expected = 0.8 * swiglu(stored(store, 1, 2)) + 0.2 * swiglu({r: narrow(qt, 2) for r, qt in stored(store, 1, 3).items()})
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_decoding_with_fallback_reads_less(store):
    ids = list(range(3, 40))
    runs = {}
    for below in (0.0, 0.45):
        model = edgemoe.load(store, torch.float32, preload="none", ram=0, fallback_below=below, compute="fused-float")
        runs[below] = (decode(model, ids), model.store.stats.disk_bytes_read, model.experts.fallback_uses)
        model.close()
    (plain, plain_bytes, none_used), (weak, weak_bytes, used) = runs[0.0], runs[0.45]
    assert none_used == 0 and used > 0 and weak_bytes < plain_bytes
    assert not torch.equal(weak, plain)


def test_resident_experts_are_never_replaced_by_copies(store):
    ids = [5, 17, 33, 2, 90, 41, 7, 64]
    full = decode(edgemoe.load(store, torch.float32, preload="none"), ids)
    logits, everything = decode_all_resident(store, ids, fallback_below=0.9)
    assert torch.equal(logits, full) and everything.experts.fallback_uses == 0


def corrupt_copy(store, tmp_path, change):
    s = tmp_path / "copy"
    shutil.copytree(store, s)
    manifest = json.loads((s / MANIFEST).read_text())
    change(manifest, s)
    (s / MANIFEST).write_text(json.dumps(manifest))
    return s


def test_a_copy_that_is_not_narrower_is_refused(store, tmp_path):
    def widen(manifest, _):
        manifest["fallback"]["experts"][0]["bits"] = 4
    with pytest.raises(StoreError, match=r"manifest.json: fallback.experts\[0\] \(layer 0 expert 0\): bits: 4, expected 2"):
        edgemoe.load(corrupt_copy(store, tmp_path, widen))


def test_a_truncated_fallback_file_is_detected_at_open(store, tmp_path):
    def truncate(manifest, s):
        (s / "fallback-00000.bin").write_bytes((s / "fallback-00000.bin").read_bytes()[:4096])
    with pytest.raises(StoreError, match="fallback-00000.bin: 4096 bytes, the manifest says"):
        edgemoe.load(corrupt_copy(store, tmp_path, truncate))


def test_a_corrupt_copy_is_detected_when_read(store, tmp_path):
    def flip(manifest, s):
        entry = manifest["fallback"]["experts"][5]
        data = bytearray((s / "fallback-00000.bin").read_bytes())
        data[entry["offset"] + 10] ^= 0x40
        (s / "fallback-00000.bin").write_bytes(bytes(data))
    s = corrupt_copy(store, tmp_path, flip)
    entry = read_manifest(s).fallback[sorted(read_manifest(s).fallback)[5]]
    with open_store(s) as opened:
        opened.get(*entry.key)                      # the expert itself is intact
        opened.cache.discard(entry.key)
        with pytest.raises(StoreError, match=f"checksum mismatch for layer {entry.layer} expert {entry.expert} "
                                             r"\(fallback-00000.bin"):
            opened.get(*entry.key, fallback=True)


def test_fallback_copies_and_full_experts_share_one_pool_of_read_buffers(store):
    """A fallback copy's read takes the buffer an evicted full expert left: no fresh buffer per size."""
    full = max(e.length for e in read_manifest(store).experts.values())
    with open_store(store, ram=2 * full, policy="lru", place_popular=False, guard=False) as s:
        if not s.disk._direct:
            pytest.skip("the file system refuses O_DIRECT: buffered reads use no pool")
        s.get(0, 0), s.get(0, 1)                       # two full experts fill the RAM tier
        for layer, expert in [(1, 0), (1, 1), (1, 2), (1, 3), (0, 2), (0, 3)]:
            s.get(layer, expert, fallback=True)         # each evicts what the tier held longest
        # Fresh buffers: the two full experts', the first copy's and (1, 3)'s, the one read while no
        # evicted buffer was released (recycled at exact sizes only, it took 6 and reused 2).
        assert s.disk.pool.allocated == 4 and s.disk.pool.reused == 4
