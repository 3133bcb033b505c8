"""The KV cache's element types (edgemoe/kv_cache.py, edgemoe/kernels/kv.py): a bfloat16 cache holds
what torch's float32 -> bfloat16 conversion gives, whether torch or a decode-engine kernel wrote
it, and hands float32 back; float32 unless the load asks for bfloat16."""

import numba
import numpy as np
import pytest
import torch

import edgemoe
from edgemoe.kv_cache import KVCache
from edgemoe.convert import convert
from edgemoe.kernels import int_paths
from edgemoe.kernels.ops import INT_PATH_ENV
from edgemoe.kernels.kv import narrow, widen
from edgemoe.model import Segment
from edgemoe.options import OptionError


@numba.njit(cache=False)
def _narrowed(x, out):
    for i in range(x.shape[0]):
        out[i] = narrow(x[i], out[i])


@numba.njit(cache=False)
def _widened(bits, out):
    for i in range(bits.shape[0]):
        out[i] = widen(bits[i])


def awkward_floats() -> torch.Tensor:
    """Ties (exactly half an ulp of bfloat16), both signs, subnormals, zeros, infinities, the largest
    finite float32 and values that round up into the next binade."""
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 - 2 ** -9, 2 ** -130, -2 ** -140])
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), torch.finfo(torch.float32).max,
                            torch.finfo(torch.float32).tiny, 3.4e38, 1 - 2 ** -24])
    spread = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 20000)
    return torch.cat((ties, special, spread)).float()


def test_a_kernel_narrows_and_widens_as_torch_converts():
    x = awkward_floats()
    expected = x.to(torch.bfloat16)
    bits = np.zeros(x.shape[0], np.int16)
    _narrowed(x.numpy(), bits)
    assert np.array_equal(bits, expected.view(torch.int16).numpy())
    back = np.zeros(x.shape[0], np.float32)
    _widened(bits, back)
    assert np.array_equal(back, expected.float().numpy())
    same = np.zeros(x.shape[0], np.float32)
    _narrowed(x.numpy(), same)                     # a float32 cache: as it is
    assert np.array_equal(same, x.numpy())


def test_a_bfloat16_cache_hands_back_float32_and_exposes_its_bits():
    cache = KVCache(2, 2, 8, dtype=torch.bfloat16, capacity=2, value_dim=4)
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 4)
    keys, values = cache.append(1, k, v)                        # grown past its capacity
    assert keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys, k.to(torch.bfloat16).float()) and torch.equal(values, v.to(torch.bfloat16).float())
    cache.advance(3)
    key_bits, value_bits = cache.layer_arrays(1, 4)
    assert key_bits.dtype == np.int16 and key_bits.shape[1] >= 4
    assert np.array_equal(key_bits[:, :3], k.to(torch.bfloat16).view(torch.int16).numpy())
    twin = cache.fork()
    twin.truncate(1)
    assert twin.length == 1 and cache.length == 3


@pytest.fixture
def store(tiny_model, tmp_path):
    path = tmp_path / "store"
    convert(tiny_model("qwen3_moe"), path, bits=8)
    return path


def test_float32_unless_bfloat16_is_asked_for(store, tiny_model):
    for path in (store, tiny_model("qwen3_moe")):
        with edgemoe.load(path) as model:
            assert model.kv_dtype == torch.float32 and model.new_cache()._k[0].dtype == torch.float32
        with edgemoe.load(path, kv_dtype="bfloat16") as model:
            assert model.kv_dtype == torch.bfloat16 and model.new_cache()._k[0].dtype == torch.bfloat16
    with pytest.raises(OptionError, match="kv_dtype="):
        edgemoe.load(store, kv_dtype="float16")


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_writes_the_bits_the_generic_forward_writes(tiny_model, tmp_path, monkeypatch, path, dtype):
    """At a sequence's first position the engine's keys and values are bit-identical to the generic
    forward's (tests/test_decode_engine.py), so their bfloat16 roundings must be too: on every
    integer path this CPU runs, from a float32 and a bfloat16 checkpoint."""
    monkeypatch.setenv(INT_PATH_ENV, path)
    store = tmp_path / "store"
    convert(tiny_model("qwen3_moe", dtype=dtype), store, bits=8)
    with edgemoe.load(store, dense_bits=8, compute="dequant", kv_dtype="bfloat16") as engine, \
            edgemoe.load(store, dense_bits=8, compute="dequant", kv_dtype="bfloat16") as generic:
        generic.decode_engine = None
        caches = [engine.new_cache(), generic.new_cache()]
        for model, cache in zip((engine, generic), caches):
            model.forward(torch.tensor([7]), [Segment(cache, 1)])
        for l in range(engine.spec.num_layers):
            ours, theirs = caches[0].layer_arrays(l, 1), caches[1].layer_arrays(l, 1)
            for a, b in zip(ours, theirs):
                assert np.array_equal(a[:, :1], b[:, :1])


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_greedy_decoding_by_the_engine_and_the_generic_forward_agree(store, kv_dtype):
    with edgemoe.load(store, dense_bits=8, compute="dequant", kv_dtype=kv_dtype) as engine, \
            edgemoe.load(store, dense_bits=8, compute="dequant", kv_dtype=kv_dtype) as generic:
        generic.decode_engine = None
        texts = [model.generate([1, 5, 9], max_new_tokens=12, temperature=0, stop_token_ids=[])
                 for model in (engine, generic)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_growth_to_is_what_appending_one_position_at_a_time_allocates(dtype):
    """growth_to(n): the arrays' bytes at n positions less today's, plus one layer's old arrays alive
    while the last growth copies them, as appending position by position (decoding) allocates."""
    def array_bytes(cache):
        return sum(t.numel() * t.element_size() for t in cache._k + cache._v)

    for start, target in ((10, 10), (10, 64), (10, 65), (70, 300), (100, 129)):
        cache = KVCache(3, 2, 8, dtype=dtype, value_dim=4)
        cache.append(0, torch.zeros(2, start, 8), torch.zeros(2, start, 4))
        for layer in (1, 2):
            cache.append(layer, torch.zeros(2, start, 8), torch.zeros(2, start, 4))
        cache.advance(start)
        before, predicted, last_old = array_bytes(cache), cache.growth_to(target), 0
        while cache.length < target:
            if cache.length == cache.capacity:     # the next append copies each layer's arrays
                last_old = array_bytes(cache) // 3
            for layer in range(3):
                cache.append(layer, torch.zeros(2, 1, 8), torch.zeros(2, 1, 4))
            cache.advance(1)
        assert predicted == array_bytes(cache) - before + last_old, (start, target)
