"""Attention over the KV cache: the one-query path against torch's own SDPA; latent attention's two
forms against the attention they stand for."""

import pytest
import torch
import torch.nn.functional as F

import edgemoe
from edgemoe import attention
from edgemoe.kv_cache import KVCache
from edgemoe.layers import attend, attention_mask


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


@pytest.mark.parametrize("absorbed", [True, False])
@pytest.mark.parametrize("queries", [1, 4])
def test_latent_attention_is_attention_over_the_expanded_keys_and_values(tiny_model, monkeypatch, absorbed, queries):
    """DeepSeek's cache keeps each position's normed latent and rope key (one row of Ckv + R, shared by
    the heads); mla_attend, absorbing kv_b or expanding the rows through it, must give what attention
    over the keys and values kv_b expands per head gives (written out here in float64)."""
    monkeypatch.setattr(attention, "absorbs", lambda spec, tokens: absorbed)
    with edgemoe.load(tiny_model("deepseek_v2")) as model:
        spec, w = model.spec, model.layers[0]
        mla = spec.attention
        H, N, R, Dv, Ckv = spec.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
        cache = model.new_cache()
        assert (cache.num_kv_heads, cache.head_dim, cache.value_dim) == (1, Ckv + R, 0)
        g = torch.Generator().manual_seed(queries)
        rows = torch.randn(1, 9, Ckv + R, generator=g)
        keys, values = cache.append(0, rows, rows.new_empty(1, 9, 0))
        q = torch.randn(queries, H, N + R, generator=g)            # the last positions' queries
        mask = attention_mask(torch.arange(9 - queries, 9), 9, None)
        got = attention.mla_attend(spec, w, q, keys, values, mask)
    kv_b = w["kv_b"].double().view(H, N + Dv, Ckv)
    latent, rope = rows[0, :, :Ckv].double(), rows[0, :, Ckv:].double()
    scale = spec.key_dim ** -0.5 if spec.attention.attention_scale is None else spec.attention.attention_scale
    expected = []
    for h in range(H):
        k = torch.cat((latent @ kv_b[h, :N].T, rope), dim=-1)      # [L, N + R]
        scores = q[:, h].double() @ k.T * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        expected.append(torch.softmax(scores, dim=-1) @ (latent @ kv_b[h, N:].T))
    assert got.shape == (queries, H * Dv)
    assert torch.allclose(got.double(), torch.stack(expected, dim=1).reshape(queries, H * Dv), atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, key_dim, value_dim, mask_kind", [
    (16, 4, 32, 32, "causal"), (8, 8, 16, 16, "window"), (6, 1, 40, 32, "causal"),   # GQA, MHA, latent-like
    (4, 4, 16, 16, "bias"),                                                           # a per-head float bias
    (8, 2, 16, 16, "sinks")])
def test_a_large_attention_goes_by_kv_head_and_query_block_with_the_one_calls_result(
        monkeypatch, heads, kv_heads, key_dim, value_dim, mask_kind):
    """Past ATTENTION_BLOCK_BYTES attend() takes one kv head's query heads at a time, in blocks of
    queries; every output must be bit for bit the single call's."""
    from edgemoe import layers
    g = torch.Generator().manual_seed(heads + kv_heads)
    queries, keys = 100, 300
    q = torch.randn(queries, heads, key_dim, generator=g)
    k = torch.randn(kv_heads, keys, key_dim, generator=g)
    v = k[..., :value_dim] if key_dim != value_dim else torch.randn(kv_heads, keys, value_dim, generator=g)
    positions = torch.arange(keys - queries, keys)
    mask = attention_mask(positions, keys, 50 if mask_kind == "window" else None)
    if mask_kind == "bias":
        mask = torch.randn(heads, queries, keys, generator=g).masked_fill(~mask, float("-inf"))
    sinks = torch.randn(heads, generator=g) if mask_kind == "sinks" else None
    whole = attend(q, k, v, mask, 0.2, sinks)
    monkeypatch.setattr(layers, "ATTENTION_BLOCK_BYTES", 1 << 16)   # blocks of at least 16 queries
    assert layers._query_block(layers._heads_per_call(heads, kv_heads), queries, keys) < queries
    assert torch.equal(attend(q, k, v, mask, 0.2, sinks), whole)


def test_a_long_prompt_chunks_attention_is_bounded_by_the_block():
    from edgemoe.layers import ATTENTION_BLOCK_BYTES, attention_peak_bytes
    assert attention_peak_bytes(16, 4, 64, 512, 256) > 0
    long = attention_peak_bytes(16, 4, 64, 512, 40960)               # 3.3 GB in one call, measured
    assert long <= ATTENTION_BLOCK_BYTES
    assert attention_peak_bytes(16, 4, 64, 512, 1 << 20) > ATTENTION_BLOCK_BYTES   # 16 queries at the least


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_gives_the_same_logits_with_its_attention_blocked(tiny_model, monkeypatch, dtype):
    """The whole model, dense weights in each dtype: a 120-token prompt's logits are bit for bit the
    same whether each layer's attention runs as one call or by kv head and block of queries."""
    from edgemoe import layers
    model = edgemoe.load(tiny_model("mixtral", max_position_embeddings=256), dtype=dtype)
    prompt = list(range(3, 123))
    whole = model.logits(prompt)
    monkeypatch.setattr(layers, "ATTENTION_BLOCK_BYTES", 1 << 12)
    assert torch.equal(model.logits(prompt), whole)
