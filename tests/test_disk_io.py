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


def test_the_pool_keeps_at_most_keep_released_buffers_of_each_size():
    pool = BufferPool(keep=2)
    buffers = [pool.take(4096) for _ in range(3)] + [pool.take(8192)]
    for b in buffers:
        pool.release(b)
    assert len(pool._released[4096]) == 2 and buffers[0] not in pool._released[4096]
    assert list(pool._released[8192]) == [buffers[3]]


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
    with open_store(store, ram="100%") as s:
        disk = s.disk
        assert disk.reads_within(1.0) is None                 # nothing measured yet
        for key in list(s.manifest.experts)[:4]:
            s.get(*key)
        assert disk.reads == 4 and disk.reads_within(None) is None
        mean = disk.read_seconds / disk.reads
        assert disk.reads_within(3 * mean) == pytest.approx(3.0)
        assert disk.reads_within(0.0) == 0.0
