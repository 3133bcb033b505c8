"""A store's load holds no float copy of what it quantizes and keeps a bfloat16 embedding as stored;
a closed store lets its experts go (docs/scheduling.md, "The RAM budget chosen for you")."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import edgemoe
from edgemoe import dense
from edgemoe.convert import convert
from edgemoe.dense import GROUP_SIZE, quantize_rows
from edgemoe.loader import dense_bytes
from edgemoe.precision import native_types
from edgemoe.quant import quantize
from edgemoe.store import read_manifest


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_reads_a_block_at_a_time_and_gives_the_whole_matrixs_codes(monkeypatch, bits, dtype):
    monkeypatch.setattr(dense, "QUANTIZE_BLOCK_BYTES", 4 * 300 * 64)     # 64 rows of 300 float32 columns
    matrix = torch.randn(1000, 300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    reads = []

    def read(start, stop):
        reads.append((start, stop))
        return matrix[start:stop]

    copy = quantize_rows(read, (1000, 300), bits, dtype)
    whole = quantize(matrix.to(dtype), bits, GROUP_SIZE[bits])
    assert reads == [(r, min(r + 64, 1000)) for r in range(0, 1000, 64)]
    for name in ("packed", "scale", "zero"):
        np.testing.assert_array_equal(getattr(copy.qt, name), getattr(whole, name), err_msg=name)
    assert copy.gemm_dtype == dtype


@pytest.fixture(scope="module")
def bf16_store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16-store") / "store"
    convert(tiny_model("qwen3_moe", dtype="bfloat16"), out, bits=4)
    return out


@pytest.mark.parametrize("dense_bits", [None, 4])
def test_a_bfloat16_embedding_is_kept_as_stored_and_computes_what_its_float32_copy_does(bf16_store, dense_bits):
    """Computing in float32, a bfloat16 embedding stays bfloat16 (half the bytes: only rows are read,
    each converted exactly); the logits are those of its float32 copy, bit for bit."""
    with edgemoe.load(bf16_store, torch.float32, ram=0, dense_bits=dense_bits) as model:
        assert model.embed.dtype == torch.bfloat16
        tokens = [3, 17, 5, 9, 1]
        kept = model.logits(tokens, model.new_cache())
        model.embed = model.embed.float()
        widened = model.logits(tokens, model.new_cache())
    torch.testing.assert_close(kept, widened, rtol=0, atol=0)
    with edgemoe.load(bf16_store, torch.bfloat16, ram=0, dense_bits=dense_bits) as model:
        assert model.embed.dtype == torch.bfloat16


def test_a_float32_embedding_computed_in_bfloat16_is_still_converted(tiny_model, tmp_path):
    """Only a widening is skipped: a float32 embedding asked for in bfloat16 is rounded as before."""
    convert(tiny_model("qwen3_moe"), tmp_path / "store", bits=4)
    with edgemoe.load(tmp_path / "store", torch.bfloat16, ram=0) as model:
        assert model.embed.dtype == torch.bfloat16


@pytest.mark.parametrize("dense_bits", [None, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dense_bytes_estimate_is_what_a_bfloat16_store_holds(bf16_store, dense_bits, dtype):
    from edgemoe.bench import dense_bytes_per_token
    with edgemoe.load(bf16_store, dtype, ram=0, dense_bits=dense_bits) as model:
        held = model.embed.nbytes + dense_bytes_per_token(model)
    assert dense_bytes(read_manifest(bf16_store), dtype, dense_bits or "none") == held


def test_loaded_dense_tensors_own_their_memory(bf16_store):
    """Read with pread, not mapped: no tensor keeps the file's mapping (and every page the load touched)."""
    with edgemoe.load(bf16_store, torch.bfloat16, ram=0) as model:
        maps = open("/proc/self/maps").read()
        assert str(bf16_store / "dense.safetensors") not in maps
        assert model.embed.dtype == torch.bfloat16


def test_closing_a_store_lets_its_experts_go_at_once(bf16_store):
    """The store sits in reference cycles (callbacks, threads) that only the cyclic collector frees:
    close() drops its resident experts and pooled buffers itself, so that a process opening another
    store meanwhile does not hold both (each expert's buffer is freed once nothing refers to it)."""
    import gc
    import weakref
    gc.disable()
    try:
        with edgemoe.load(bf16_store, ram="100%") as model:
            model.logits([3, 17, 5], model.new_cache())
            store = model.store
            buffers = [weakref.ref(item.blob.base.obj) for tier in store.cache.tiers for item in tier.items.values()
                       if item.blob is not None and hasattr(item.blob.base, "obj")]
            assert store.cache.count() > 0 and buffers
        assert store.cache.count() == 0 and not store.disk.pool._released
        del model
        assert all(ref() is None for ref in buffers)
    finally:
        gc.enable()



BFLOAT16_SHAPES = """
import sys
if sys.argv[1] == "edgemoe":
    import edgemoe
import torch
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
torch.set_num_threads(1)
up, down = torch.randn(2048, 512).bfloat16(), torch.randn(512, 2048).bfloat16()
before = rss()
for rows in range(1, 301):        # an expert's products at a row count of their own each time
    torch.nn.functional.linear(torch.nn.functional.linear(torch.randn(rows, 512).bfloat16(), up), down)
print(rss() - before)
"""


@pytest.mark.skipif(torch.bfloat16 not in native_types(),
                    reason="this CPU has no native bfloat16 products: the dense matrices and the experts' "
                           "GEMMs are float32 here, and oneDNN's bfloat16 kernels are not used")
def test_bfloat16_products_of_ever_new_shapes_pile_up_less_memory_under_edgemoe():
    """oneDNN keeps every bfloat16 product shape it has seen (1024 by default); importing edgemoe
    bounds that cache, so 300 expert batches of as many row counts grow the process by less
    (measured on an AVX-512 BF16 EPYC: 404 MiB without, 256 with the bound at 32)."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    growth = {how: int(subprocess.run([sys.executable, "-c", BFLOAT16_SHAPES, how], env=env, check=True,
                                      capture_output=True, text=True).stdout) for how in ("edgemoe", "plain")}
    assert growth["plain"] - growth["edgemoe"] > 64 << 20


FINITE_CHECK_PEAK = """
import sys, torch
from edgemoe.checkpoint import all_finite
def status(field): return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) << 10
t = torch.ones(16 << 20, dtype=torch.bfloat16)          # 32 MiB; a float64 copy of it would be 128 MiB
t[int(sys.argv[1])] = float("nan") if sys.argv[1] != "-1" else 1.0
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
print(all_finite(t), status("VmHWM") - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads the peak resident set from /proc/self/status")
@pytest.mark.parametrize("nan_at", [-1, 0, (16 << 20) - 1])
def test_checking_a_bfloat16_tensor_for_non_finite_values_takes_no_float64_copy_of_it(nan_at):
    """all_finite sums a block at a time in float64: the check of a 32 MiB bfloat16 tensor raises the
    peak by at most half the 128 MiB that sum(dtype=float64) of the whole would copy, and still finds
    a nan in the first or the last block. The allocator may keep a few freed 8 MiB blocks: 18 runs
    alone rose by 9.9-35.6 MiB, so a 32 MiB bound failed about one run in twenty."""
    done = subprocess.run([sys.executable, "-c", FINITE_CHECK_PEAK, str(nan_at)], check=True, capture_output=True,
                          text=True).stdout.split()
    assert done[0] == str(nan_at == -1) and int(done[1]) < 64 << 20
