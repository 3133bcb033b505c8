"""Attention over the KV cache: the one-query path against torch's own SDPA."""

import pytest
import torch
import torch.nn.functional as F

from edgemoe.kv_cache import KVCache
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
