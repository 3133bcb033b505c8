"""The decode engine (edgemoe/decode.py): a one-token step's attention block in one kernel call per
layer, against the generic forward it replaces.

Where the token is the sequence's first, attention over one key is exact (softmax of one score is 1),
so the engine's residual stream and MoE input must equal the generic forward's bit for bit: every
other part (norms, integer projections, biases, q/k norms, clip, rotary, residual) is computed in
the generic path's order. Later positions differ in the attention's last bits (fastmath sums), so
decoding is compared within a tolerance, and greedy tokens must agree."""

import pytest
import torch

import edgemoe
from edgemoe import attention
from edgemoe.convert import convert
from edgemoe.kv_cache import KVCache
from edgemoe.decode import DecodeEngine
from edgemoe.kernels import int_paths
from edgemoe.kernels.ops import INT_PATH_ENV
from edgemoe.layers import linear
from edgemoe.model import Segment
from edgemoe.store import read_manifest

ENGINE_ARCHS = [("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}), ("olmoe", {}), ("gpt_oss", {}),
                ("phimoe", {}), ("deepseek_v2", {}), ("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": None}),
                ("deepseek_v3", {"attention_bias": True})]


@pytest.fixture
def store_of(tiny_model, tmp_path):
    def make(arch, **overrides):
        path = tmp_path / arch
        convert(tiny_model(arch, **overrides), path, bits=8)
        return path
    return make


def load(path, engine=True):
    # The experts' path held at dequantize + matmul. Chosen by measured latency, it could differ
    # between runs; and the integer path's int8 activations would turn a last-bit difference in an
    # expert's input into a whole int8 step (up to 1/127 of the input's largest value), hiding the
    # engine's own error. The integer path's bits are tested on their own
    # (test_first_position_is_bit_identical_on_every_integer_path_and_dtype).
    model = edgemoe.load(path, dense_bits=8, compute="dequant")
    if not engine:
        model.decode_engine = None
    return model


@pytest.mark.parametrize("arch, overrides", ENGINE_ARCHS)
def test_the_engine_runs_the_layers_of_its_kind(store_of, tiny_model, arch, overrides):
    with load(store_of(arch, **overrides)) as model:
        assert model.decode_engine is not None
    with edgemoe.load(tiny_model(arch, **overrides)) as model:   # float matrices: not its kind
        assert model.decode_engine is None


def first_layer_step(model, token):
    """The first MoE layer on the first token of a fresh cache: (residual stream after attention, MoE
    input, router logits)."""
    x = model.embeddings(torch.tensor([token]))
    positions = torch.tensor([0])
    cos, sin = model._rope(positions)
    l = model.spec.moe_layer_ids[0]
    cache, w = model.new_cache(), model.layers[l]
    if model.decode_engine is not None:
        return model.decode_engine.layer(l, x, 0, cos, sin, cache) + (cache,)
    x = x + model._attention(l, w, model._norm(x, w, "attn_norm"), positions, cos, sin, [Segment(cache, 1)])
    h = model._norm(x, w, "mlp_norm")
    return x, h, linear(h, w["router"]).float(), cache


def expand_latents(monkeypatch):
    """The generic forward's latent attention held at its expanded form: kv_b's rows on the integer
    path, as the engine computes each head's values (the absorbed form's float products differ from
    them by the int8 activation step, not by the engine's error)."""
    monkeypatch.setattr(attention, "absorbs", lambda spec, tokens: False)


@pytest.mark.parametrize("arch, overrides", ENGINE_ARCHS)
def test_first_position_is_bit_identical_to_the_generic_forward(store_of, monkeypatch, arch, overrides):
    expand_latents(monkeypatch)
    path = store_of(arch, **overrides)
    with load(path) as engine, load(path, engine=False) as generic:
        for token in (3, 17):
            x, h, logits, cache = first_layer_step(engine, token)
            rx, rh, rlogits, rcache = first_layer_step(generic, token)
            if arch in ("gpt_oss", "phimoe"):   # an attention sink's share of the softmax; LayerNorm: not exact
                assert torch.allclose(x, rx, rtol=1e-5, atol=1e-6) and torch.allclose(h, rh, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(x, rx) and torch.equal(h, rh)
                l = engine.spec.moe_layer_ids[0]
                assert torch.equal(cache._k[l][:, :1], rcache._k[l][:, :1])
                assert torch.equal(cache._v[l][:, :1], rcache._v[l][:, :1])
            assert torch.allclose(logits, rlogits, rtol=1e-5, atol=1e-5)


def stepwise_logits(engine, generic, prompt, steps):
    """Greedy decoding by the generic forward; at each step, the engine's logits from the same cache
    (a fork), so that each step's difference is the engine's alone, not the drift of earlier ones."""
    cache = generic.new_cache()
    logits = generic.forward(torch.tensor(prompt), [Segment(cache, len(prompt))], last_only=True)[-1]
    pairs = []
    for _ in range(steps):
        token = torch.tensor([int(logits.argmax())])
        fork = cache.fork()
        ours = engine.forward(token, [Segment(fork, 1)], last_only=True)[-1]
        logits = generic.forward(token, [Segment(cache, 1)], last_only=True)[-1]
        pairs.append((ours, logits))
    return pairs


# Phi-3.5-MoE's sparsemixer weighs an expert by a mask over relative logit gaps, a step function of
# the logits: the engine's last-bit differences may move a weight, so its steps are compared at the
# attention blocks (test_each_attention_block_matches_the_generic_forward) rather than at the logits.
CONTINUOUS_ROUTERS = [(arch, overrides) for arch, overrides in ENGINE_ARCHS if arch != "phimoe"]


# Latent attention: the engine absorbs kv_b and quantizes each head's attention-weighted latent to
# int8 for kv_b's value rows, where the generic forward expands each cached latent on the integer path
# (or, absorbing, multiplies in float): different roundings of one product, about 1% of the
# attention's output apart, enough to swap the tiny random models' close top logits. So latent
# attention is compared at the first position (bit for bit, above) and block by block against float
# weights (below), not here.
LATENT = ("deepseek_v2", "deepseek_v3")


@pytest.mark.parametrize("arch, overrides", [(a, o) for a, o in CONTINUOUS_ROUTERS if a not in LATENT]
                         + [("mixtral", {"sliding_window": 3})])
def test_decoding_matches_the_generic_forward(store_of, arch, overrides):
    path = store_of(arch, **overrides)
    with load(path) as engine, load(path, engine=False) as generic:
        for ours, reference in stepwise_logits(engine, generic, [1, 5, 9, 2, 7], 10):
            assert int(ours.argmax()) == int(reference.argmax())
            assert (ours - reference).abs().max() <= 1e-3 * reference.abs().max()


@pytest.mark.parametrize("arch, overrides", [(a, o) for a, o in ENGINE_ARCHS if a in LATENT])
def test_latent_attention_is_as_close_to_float_weights_as_the_generic_forward(store_of, monkeypatch, arch,
                                                                            overrides):
    """Every layer's attention block at later positions, from one input and cache: the engine's and the
    generic forward's (expanded, on the integer path), each against the same block with float dense
    weights; the engine's error within 1.5x the generic one's on average, 2x at worst (measured: 0.9x to
    1.1x). A wrong head, row or scale would be off by the attention's whole size."""
    expand_latents(monkeypatch)
    path = store_of(arch, **overrides)
    with edgemoe.load(path, compute="dequant") as floats, load(path, engine=False) as quantized:
        assert floats.dense_bits is None
        engine = DecodeEngine.for_model(quantized.spec, quantized.layers)
        cache = floats.new_cache()
        floats.forward(torch.tensor([1, 5, 9, 2, 7, 4, 4, 8, 10, 12, 3]), [Segment(cache, 11)])
        errors = {"engine": [], "generic": []}
        for token in (3, 8, 1, 4, 6):
            x = floats.embeddings(torch.tensor([token]))
            cos, sin = floats._rope(torch.tensor([cache.length]))
            for l in range(floats.spec.num_layers):
                reference, _ = generic_block(floats, l, x, cache.length, cache.fork())
                ours, _, _ = engine.layer(l, x, cache.length, cos, sin, cache.fork())
                generic, _ = generic_block(quantized, l, x, cache.length, cache.fork())
                size = (reference - x).abs().max()
                errors["engine"].append(float((ours - reference).abs().max() / size))
                errors["generic"].append(float((generic - reference).abs().max() / size))
            floats.forward(torch.tensor([token]), [Segment(cache, 1)])
    engine_errors, generic_errors = torch.tensor(errors["engine"]), torch.tensor(errors["generic"])
    assert engine_errors.mean() <= 1.5 * generic_errors.mean()
    assert engine_errors.max() <= 2 * generic_errors.max()


def generic_block(model, l, x, position, cache):
    """The generic forward's attention block of layer l at `position` (the cache's length)."""
    w, positions = model.layers[l], torch.tensor([position])
    cos, sin = model._rope(positions)
    x = x + model._attention(l, w, model._norm(x, w, "attn_norm"), positions, cos, sin, [Segment(cache, 1)])
    return x, model._norm(x, w, "mlp_norm")


@pytest.mark.parametrize("arch, overrides", [("phimoe", {}), ("qwen3_moe", {}), ("gpt_oss", {})])
def test_each_attention_block_matches_the_generic_forward(store_of, arch, overrides):
    """Every layer's block at later positions, from the same input and cache: within float32 rounding
    (and a rare int8 step of the output projection's input)."""
    with load(store_of(arch, **overrides), engine=False) as model:
        engine = DecodeEngine.for_model(model.spec, model.layers)
        cache = model.new_cache()
        model.forward(torch.tensor([1, 5, 9, 2, 7]), [Segment(cache, 5)])
        for token in (3, 8, 1, 4):
            x = model.embeddings(torch.tensor([token]))
            cos, sin = model._rope(torch.tensor([cache.length]))
            for l in range(model.spec.num_layers):
                ours, ours_h, _ = engine.layer(l, x, cache.length, cos, sin, cache.fork())
                reference, reference_h = generic_block(model, l, x, cache.length, cache.fork())
                for a, b in ((ours, reference), (ours_h, reference_h)):
                    assert (a - b).abs().max() <= 1e-3 * b.abs().max()
            model.forward(torch.tensor([token]), [Segment(cache, 1)])


def test_the_engine_is_what_a_decode_step_runs(store_of, monkeypatch):
    """One call per layer, and none of the generic attention's."""
    calls = []
    with load(store_of("qwen3_moe")) as model:
        monkeypatch.setattr(model, "_attention", lambda *a: calls.append("generic"))
        layer = model.decode_engine.layer
        monkeypatch.setattr(model.decode_engine, "layer", lambda *a: calls.append("engine") or layer(*a))
        cache = model.new_cache()
        model.forward(torch.tensor([4]), [Segment(cache, 1)])
    assert calls == ["engine"] * model.spec.num_layers


def test_a_grown_cache_keeps_earlier_positions(store_of):
    """The kernel writes into the cache's arrays: past the first capacity they are reallocated, and
    decoding on must match a cache that was large from the start."""
    path = store_of("mixtral")
    with load(path) as model:
        def run(capacity):
            cache = KVCache.for_spec(model.spec, capacity=capacity)
            out = [model.forward(torch.tensor([t]), [Segment(cache, 1)])[-1] for t in range(1, 12)]
            return torch.stack(out)
        assert torch.equal(run(2), run(64))


def test_greedy_text_is_the_same_whatever_the_budget_and_policy(store_of):
    """The tiering invariant through the engine: what is resident never changes a token."""
    path = store_of("qwen2_moe", num_experts=6)
    entry = max(e.length for e in read_manifest(path).experts.values())
    outputs = []
    for options in (dict(), dict(ram=0), dict(ram=2 * entry, policy="lru"),
                    dict(ram=3 * entry, policy="frequency-distance", preload="lookahead")):
        with edgemoe.load(path, dense_bits=8, **options) as model:
            assert model.decode_engine is not None
            outputs.append(model.generate([1, 5, 9], max_new_tokens=12, temperature=0, stop_token_ids=[]))
    assert outputs[1:] == outputs[:-1]


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])     # grouped-query and latent attention
def test_first_position_is_bit_identical_on_every_integer_path_and_dtype(store_of, monkeypatch, path, dtype, arch):
    """The bit-identity above with each integer path this CPU runs forced (both forwards take it
    from the environment) and with a bfloat16 checkpoint (its dense matrices quantized alike)."""
    monkeypatch.setenv(INT_PATH_ENV, path)
    expand_latents(monkeypatch)
    store = store_of(arch, dtype=dtype)
    with load(store) as engine, load(store, engine=False) as generic:
        x, h, _, _ = first_layer_step(engine, 11)
        rx, rh, _, _ = first_layer_step(generic, 11)
    assert torch.equal(x, rx) and torch.equal(h, rh)
