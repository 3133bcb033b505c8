"""serve and chat's context (--context; edgemoe.loader.served_context): auto keeps the model's context
where one sequence at it leaves room to cache every expert, else the longest of 4096 and its doublings
that does; a KV cache stops growing at the context it is served at; a prompt that fills a served
context is refused, naming --context."""

import math

import pytest
import torch

import edgemoe
from edgemoe.convert import convert
from edgemoe.errors import ContextLengthError
from edgemoe.generate import Generation, GenerationOptions, step, stream_tokens
from edgemoe.kv_cache import KVCache
from edgemoe.loader import MIN_AUTO_CONTEXT, StoreOptions, kv_cache_bytes, run_needs, served_context
from edgemoe.options import OptionError
from edgemoe.store.format import read_manifest
from edgemoe.store.memory import MARGIN_FIXED, MARGIN_SHARE

LONG_CONTEXT = 8 * MIN_AUTO_CONTEXT      # 32,768 positions, Mixtral's
AUTO = StoreOptions(ram="auto")


@pytest.fixture(scope="module")
def long_store(tiny_model, tmp_path_factory):
    """A tiny Mixtral-shaped store whose context is 32,768 tokens."""
    store = tmp_path_factory.mktemp("long") / "store"
    convert(tiny_model("mixtral", max_position_embeddings=LONG_CONTEXT), store, bits=4)
    return store


def meminfo_root(root, available: int):
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    return root


def available_to_cache_every_expert(store, context: int) -> int:
    """The fewest bytes (whole KiB) under which ram="auto" caches every expert beside one sequence of
    `context` tokens (ram_budget: available - needs - margin >= expert bytes)."""
    manifest = read_manifest(store)
    needs = sum(run_needs(manifest, None, "auto", context, 1, cap_context=True).values())
    return 1024 * math.ceil((needs + MARGIN_FIXED + manifest.expert_bytes) / (1 - MARGIN_SHARE) / 1024 + 1)


def test_auto_keeps_the_whole_context_where_every_expert_still_fits(long_store, tmp_path):
    root = meminfo_root(tmp_path, available_to_cache_every_expert(long_store, LONG_CONTEXT))
    served = served_context(long_store, None, AUTO, root=root)
    assert (served.tokens, served.shortened) == (LONG_CONTEXT, False)


@pytest.mark.parametrize("fits_at", [MIN_AUTO_CONTEXT, 2 * MIN_AUTO_CONTEXT, 4 * MIN_AUTO_CONTEXT])
def test_auto_takes_the_longest_doubling_of_4096_that_leaves_every_expert_room(long_store, tmp_path, fits_at):
    root = meminfo_root(tmp_path, available_to_cache_every_expert(long_store, fits_at))
    served = served_context(long_store, None, AUTO, root=root)
    assert served.tokens == fits_at and served.shortened
    assert f"--context {LONG_CONTEXT}" in served.why


def test_auto_serves_4096_where_no_context_leaves_every_expert_room(long_store, tmp_path):
    root = meminfo_root(tmp_path, available_to_cache_every_expert(long_store, MIN_AUTO_CONTEXT) - (1 << 20))
    assert served_context(long_store, None, AUTO, root=root).tokens == MIN_AUTO_CONTEXT


def test_auto_keeps_the_whole_context_without_a_trade_to_make(long_store, tiny_model, tmp_path):
    tight = meminfo_root(tmp_path, 1 << 20)
    assert served_context(long_store, None, StoreOptions(ram="25%"), root=tight).tokens == LONG_CONTEXT
    assert served_context(long_store, None, AUTO, root=tmp_path / "unknown").tokens == LONG_CONTEXT
    checkpoint = tiny_model("mixtral", max_position_embeddings=LONG_CONTEXT)
    assert served_context(checkpoint, None, AUTO, root=tight).tokens == LONG_CONTEXT
    short = tiny_model("mixtral", max_position_embeddings=1024)
    assert served_context(short, None, AUTO, root=tight).tokens == 1024


def test_a_requested_context_is_taken_up_to_the_models(long_store):
    assert served_context(long_store, 1000, AUTO).tokens == 1000
    with pytest.raises(OptionError, match="--context.*longer than the model's context of 32768"):
        served_context(long_store, LONG_CONTEXT + 1, AUTO)


def test_a_capped_cache_stops_at_its_limit_and_growth_to_says_what_it_allocates():
    cache = KVCache(2, 2, 8, limit=100)
    cache_bytes = lambda: sum(t.nbytes for t in cache._k + cache._v)    # noqa: E731
    per_position = cache_bytes() // cache.capacity
    assert cache.capacity == 64
    expected_growth = cache.growth_to(100)
    before = cache_bytes()
    for position in range(100):
        cache.layer_arrays(0, position + 1)
        cache.layer_arrays(1, position + 1)
    assert cache.capacity == 100 and cache_bytes() - before == per_position * 36
    assert expected_growth == per_position * 36 + per_position // 2 * 64   # and one layer's old arrays
    assert KVCache(2, 2, 8, limit=16).capacity == 16
    cache.layer_arrays(0, 101)                                              # past the limit, it grows
    assert cache._k[0].shape[1] >= 101


def test_a_served_context_caps_the_models_caches_and_refuses_a_prompt_that_fills_it(long_store):
    context = 96
    model = edgemoe.load(long_store, ram="auto", context=context, cap_context=True)
    try:
        assert model.context_length == context and model.new_cache().limit == context
        ids = list(range(5, 5 + context - 10))
        generation = Generation(model, ids, GenerationOptions(max_new_tokens=50, temperature=0.0, stop_token_ids=[]))
        while not generation.finished:
            step(model, [generation])
            cache = generation.feed.state if generation.feed is not None else cache
        assert len(generation.output) == 10 and cache.capacity == context      # stopped at the context
        assert sum(t.nbytes for t in cache._k + cache._v) <= kv_cache_bytes(model.spec, context, limit=context)
        with pytest.raises(ContextLengthError, match=f"the served context is {context} \\(--context\\)"):
            list(stream_tokens(model, list(range(5, 5 + context)), GenerationOptions(max_new_tokens=1)))
    finally:
        model.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_capped_cache_gives_the_tokens_an_uncapped_one_gives(long_store, dtype):
    opts = GenerationOptions(max_new_tokens=30, temperature=0.0, stop_token_ids=[])
    prompt = list(range(7, 47))
    outputs = []
    for cap in (False, True):
        model = edgemoe.load(long_store, dtype=dtype, ram="auto", context=80, cap_context=cap)
        try:
            outputs.append(list(stream_tokens(model, prompt, opts)))
        finally:
            model.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 30
