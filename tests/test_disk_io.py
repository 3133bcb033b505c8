"""The disk tier's read paths: O_DIRECT into recycled buffers (the default) and buffered reads give the
same experts and the same logits; a recycled buffer is never one that something still reads."""

import numpy as np
import pytest
import torch

import edgemoe
from edgemoe.convert import convert
from edgemoe.store import open_store
from edgemoe.store.disk import BufferPool
from helpers import decode


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("io") / "store"
    convert(tiny_model("mixtral"), out, bits=4)
    return out


def test_a_released_buffer_is_reused_only_once_nothing_views_it():
    pool = BufferPool(keep=2)
    buffer = pool.take(8192)
    first = id(buffer)
    view = np.frombuffer(buffer, dtype=np.uint8, count=5000)[64:128].view(np.float32)
    pool.release(buffer)
    del buffer                                      # only the view (and the pool) refer to it now
    other = pool.take(8192)
    assert id(other) != first                       # still viewed: a fresh buffer instead
    del view
    again = pool.take(8192)
    assert id(again) == first and pool.reused == 1
    pool.release(pool.take(4096))
    assert pool.reused == 1 and len(pool.take(8192)) == 8192   # sizes must match: a fresh one


def test_the_pool_keeps_at_most_keep_released_buffers_the_oldest_dropped():
    pool = BufferPool(keep=2)
    buffers = [pool.take(4096), pool.take(8192), pool.take(4096)]
    for b in buffers:
        pool.release(b)
    assert list(pool._released) == buffers[1:]


def test_a_larger_released_buffer_serves_a_smaller_read_best_fit_never_one_still_viewed():
    pool = BufferPool(keep=4)
    buffers = {"large": pool.take(6 * 4096), "medium": pool.take(4 * 4096), "viewed": pool.take(3 * 4096)}
    ids = {name: id(b) for name, b in buffers.items()}
    buffers["large"][:] = b"\x01" * (6 * 4096)           # its pages are in memory now
    view = np.frombuffer(buffers["viewed"], dtype=np.uint8)   # an expert still computing from it
    for name in list(buffers):
        pool.release(buffers.pop(name))                   # only the pool (and the view) refer to them
    assert id(pool.take(2 * 4096)) == ids["medium"] and pool.reused == 1   # the smallest that fits
    large = pool.take(5 * 4096)
    assert id(large) == ids["large"] and pool.reused == 2
    assert large[:5 * 4096] == b"\x01" * (5 * 4096)      # the part the read needs is kept
    assert large[5 * 4096:] == bytes(4096)               # the tail's pages were given back (zero when touched)
    assert id(pool.take(3 * 4096)) != ids["viewed"] and pool.allocated == 4   # still viewed: a fresh one
    del view
    assert id(pool.take(3 * 4096)) == ids["viewed"]


def test_direct_and_buffered_reads_decode_alike_and_direct_recycles(store):
    ids = [5, 17, 33, 2, 90, 41, 7, 64, 12, 3]
    logits = {}
    for io in ("direct", "buffered"):
        with edgemoe.load(store, torch.float32, io=io, ram="30%", preload="none", compute="fused-float") as model:
            logits[io] = decode(model, ids)
            if io == "direct" and model.store.disk._direct:   # O_DIRECT where the file system allows it
                assert model.store.disk.pool.reused > 0
    assert torch.equal(logits["direct"], logits["buffered"])


def test_an_evicted_expert_still_in_use_keeps_its_bytes(store):
    with open_store(store, ram=0, io="direct") as s:        # nothing cached: every read leaves at once
        held = s.get(0, 1)
        before = {role: qt.packed.copy() for role, qt in held.tensors.items()}
        for layer in (0, 1):
            for expert in range(4):
                s.get(layer, expert)                        # reads that may take released buffers
        assert s.disk.pool.reused > 0 or not s.disk._direct
        assert all(np.array_equal(held.tensors[role].packed, before[role]) for role in before)


def test_reads_within_a_time_follow_the_measured_mean_read(store):
    """The one disk-time estimate the preloader's credit and a speculative draft's prefetch budget use."""
    with open_store(store, ram="100%", place_popular=False) as s:   # not filled at open: no read yet
        disk = s.disk
        assert disk.reads_within(1.0) is None                 # nothing measured yet
        for key in list(s.manifest.experts)[:4]:
            s.get(*key)
        assert disk.reads == 4 and disk.reads_within(None) is None
        mean = disk.read_seconds / disk.reads
        assert disk.reads_within(3 * mean) == pytest.approx(3.0)
        assert disk.reads_within(0.0) == 0.0
