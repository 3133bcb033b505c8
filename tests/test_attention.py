"""Attention over the KV cache: the one-query path against torch's own SDPA."""

import pytest
import torch
import torch.nn.functional as F

from edgemoe.cache import KVCache
from edgemoe.layers import attend


@pytest.mark.parametrize("heads, kv_heads, scale", [(16, 4, None), (8, 8, 0.3), (6, 1, None)])
def test_one_query_reads_the_cache_as_sdpa_would(heads, kv_heads, scale):
    g = torch.Generator().manual_seed(heads)
    cache = KVCache(1, kv_heads, 32, value_dim=24, capacity=64)     # 37 of 64 positions: strided views
    keys, values = cache.append(0, torch.randn(kv_heads, 37, 32, generator=g), torch.randn(kv_heads, 37, 24, generator=g))
    q = torch.randn(1, heads, 32, generator=g)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, enable_gqa=True, scale=scale)
    got = attend(q, keys, values, None, scale)
    assert got.shape == (1, heads * 24)
    assert torch.allclose(got, expected.transpose(0, 1).reshape(1, -1), atol=1e-6)


@pytest.mark.parametrize("heads, kv_heads, scale, cached", [(16, 4, None, 37), (8, 8, 0.3, 0), (6, 1, None, 63)])
def test_the_decode_kernel_appends_and_attends_as_sdpa_would(heads, kv_heads, scale, cached):
    """attend_one_cached (one numba call) against cache.append + SDPA, from an empty cache and across
    a growth of the cache's capacity (63 cached of 64: the new position needs a bigger one)."""
    from edgemoe.layers import attend_one_cached

    g = torch.Generator().manual_seed(heads + cached)
    history = torch.randn(kv_heads, cached, 32, generator=g), torch.randn(kv_heads, cached, 24, generator=g)
    q, k, v = torch.randn(1, heads, 32, generator=g), torch.randn(1, kv_heads, 32, generator=g), torch.randn(1, kv_heads, 24, generator=g)
    cache = KVCache(1, kv_heads, 32, value_dim=24, capacity=64)
    cache.append(0, *history)
    cache.advance(cached)
    got = attend_one_cached(q, k, v, cache, 0, scale)
    cache.advance(1)
    keys, values = torch.cat([history[0], k.transpose(0, 1)], 1), torch.cat([history[1], v.transpose(0, 1)], 1)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, enable_gqa=True, scale=scale)
    assert got.shape == (1, heads * 24)
    assert torch.allclose(got, expected.transpose(0, 1).reshape(1, -1), atol=1e-6)
    stored_k, stored_v = cache.storage(0, 0)
    assert torch.equal(stored_k[:, :cached + 1], keys) and torch.equal(stored_v[:, :cached + 1], values)
