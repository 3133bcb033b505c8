"""A decode step with every expert resident in RAM: the decode engine runs the token through every
layer in one kernel call (DecodeEngine.step), or each layer's MoE block in one call after its
attention block (DecodeEngine.moe) where a step cannot run whole. Both must give the bits of the
layer-by-layer path they replace (the attention block's kernel, then the experts' layer kernel and
the ordered weighted sum: StoreExperts.run), the same hits, and show the hooks what it shows them."""

import pytest
import torch

import edgemoe
from edgemoe.convert import convert
from edgemoe.decode import DecodeEngine
from edgemoe.kernels import cpu_layer, int_paths
from edgemoe.kernels.ops import INT_PATH_ENV
from edgemoe.model import Segment

PROMPT, STEPS = [1, 5, 9, 2], [7, 3, 11, 4, 8]


@pytest.fixture
def store_of(tiny_model, tmp_path):
    def make(arch, bits=4, **overrides):
        path = tmp_path / f"{arch}-{bits}-{'-'.join(f'{k}{v}' for k, v in sorted(overrides.items()))}"
        if not path.exists():
            convert(tiny_model(arch, **overrides), path, bits=bits)
        return path
    return make


def counted(monkeypatch, method):
    """Counts calls of a DecodeEngine method, each one kernel call: step (decode_token_kernel) or moe
    (moe_block_kernel). The kernels themselves stay unpatched: decode_token_kernel calls
    moe_block_kernel, and numba compiles what the module's name holds."""
    calls = []
    original = getattr(DecodeEngine, method)

    def call(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecodeEngine, method, call)
    return calls


def decode(path, way, monkeypatch, routing=None, **options):
    """Prefill, then one-token steps, every expert resident first; `way`: "step" (the default), "layer"
    (no whole-token call), "generic" (neither: the engine's attention block, then StoreExperts.run);
    routing: a replayed trace's (the model's routing_override). Returns the steps' logits, the store's
    counts (RAM hits, bytes requested) and what the hooks saw."""
    seen = []
    with edgemoe.load(path, **{"dense_bits": 8, "compute": "fused-int", "preload": "none", **options}) as model:
        for entry in model.store.experts():
            model.store.get(*entry.key)
        if way != "step":
            monkeypatch.setattr(model.experts, "resident_step_layouts", lambda first: None)
        if way == "generic":
            monkeypatch.setattr(model.experts, "resident_layouts", lambda l: None)
        model.routing_override = routing
        model.add_moe_input_hook(lambda l, h: seen.append(("input", l, h.clone())))
        model.add_routing_hook(lambda l, experts, weights, positions, segments:
                               seen.append(("routing", l, experts.tolist(), weights.tolist(), positions.tolist())))
        cache = model.new_cache()
        model.forward(torch.tensor(PROMPT), [Segment(cache, len(PROMPT))])
        seen.clear()
        stats = model.store.stats
        hits, requested = stats.ram.hits, stats.requested_bytes
        logits = torch.stack([model.forward(torch.tensor([t]), [Segment(cache, 1)])[-1] for t in STEPS])
        return logits, (stats.ram.hits - hits, stats.requested_bytes - requested), seen


def same(a, b):
    """Two runs' logits, store counts and hook records, bit for bit."""
    assert torch.equal(a[0], b[0])
    assert a[1] == b[1]
    assert len(a[2]) == len(b[2])
    for x, y in zip(a[2], b[2]):
        assert x[:2] == y[:2]
        assert torch.equal(x[2], y[2]) if x[0] == "input" else x[2:] == y[2:]


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch, overrides", [("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 8}),
                                             ("mixtral", {}), ("olmoe", {}), ("gpt_oss", {"num_experts_per_tok": 2}),
                                             ("phimoe", {"router_jitter_noise": 0.5}), ("qwen2_moe", {})])
def test_a_step_in_one_call_gives_the_layer_by_layer_bits(store_of, monkeypatch, path, kv_dtype, arch, overrides):
    """On each integer path this CPU runs (forced), with a float32 and a bfloat16 KV cache, on
    routers that renormalise the top-k weights (qwen3_moe, mixtral), one that does not (olmoe),
    GPT-OSS's (the biased top-k softmaxed; its experts a clamped SwiGLU with biases; attention sinks
    and sliding windows), Phi-3.5-MoE's sparsemixer (LayerNorm, attention biases; a jitter that
    keeps several candidates in each softmax) and Qwen2-MoE's (a wider shared expert behind a
    sigmoid gate, beside the routed ones)."""
    monkeypatch.setenv(INT_PATH_ENV, path)
    store = store_of(arch, **overrides)
    steps, moe_blocks = counted(monkeypatch, "step"), counted(monkeypatch, "moe")
    whole = decode(store, "step", monkeypatch, kv_dtype=kv_dtype)
    assert len(steps) == len(STEPS) and not moe_blocks
    by_layer = decode(store, "layer", monkeypatch, kv_dtype=kv_dtype)
    with edgemoe.load(store) as model:
        layers, top_k = model.spec.num_layers, model.spec.top_k
    assert len(moe_blocks) == len(STEPS) * layers and len(steps) == len(STEPS)
    generic = decode(store, "generic", monkeypatch, kv_dtype=kv_dtype)
    assert len(moe_blocks) == len(STEPS) * layers
    same(whole, by_layer)
    same(whole, generic)
    assert whole[1][0] == len(STEPS) * layers * top_k and whole[1][1] > 0


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("arch, overrides", [("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 8}),
                                             ("qwen2_moe", {})])
def test_a_bfloat16_checkpoint_gives_the_layer_by_layer_bits(store_of, monkeypatch, path, arch, overrides):
    """What --dtype auto loads on a CPU with bfloat16 (the embedding and routers bfloat16, the dense
    projections and a shared expert quantized from bfloat16 weights): the step's bits are still the
    layer-by-layer path's."""
    monkeypatch.setenv(INT_PATH_ENV, path)
    store = store_of(arch, dtype="bfloat16", **overrides)
    options = dict(dtype=torch.bfloat16)
    steps = counted(monkeypatch, "step")
    whole = decode(store, "step", monkeypatch, **options)
    assert len(steps) == len(STEPS)
    same(whole, decode(store, "generic", monkeypatch, **options))


def test_mixed_widths_and_a_grown_cache_keep_the_bits(store_of, monkeypatch):
    """A store whose experts are INT4 and INT8 (each layer's table at several widths), and a cache
    that grows past its first capacity inside the steps (its arrays reallocated: the kernel must be
    given the new addresses)."""
    store = store_of("mixtral", bits=8)
    from edgemoe.kv_cache import KVCache
    results = []
    for way in ("step", "generic"):
        with edgemoe.load(store, dense_bits=8, compute="fused-int", preload="none") as model:
            for entry in model.store.experts():
                model.store.get(*entry.key)
            if way == "generic":
                monkeypatch.setattr(model.experts, "resident_step_layouts", lambda first: None)
                monkeypatch.setattr(model.experts, "resident_layouts", lambda l: None)
            spec = model.spec
            cache = KVCache.for_spec(spec, capacity=2)
            results.append(torch.stack([model.forward(torch.tensor([t]), [Segment(cache, 1)])[-1]
                                        for t in PROMPT + STEPS]))
    assert torch.equal(*results)


def replayed(l, positions):
    """A replayed trace's choice: by layer and position, one expert chosen twice at some positions."""
    experts = [[(p + l) % 4, (p * 3 + 1) % 4] if p % 3 else [2, 2] for p in positions.tolist()]
    return torch.tensor([[0.625, 0.375]] * len(experts)), torch.tensor(experts)


@pytest.mark.parametrize("way", ["step", "layer"])
def test_replayed_routing_runs_in_the_engine_with_the_generic_bits(store_of, monkeypatch, way):
    """The bench routes a random-weight model by a replayed trace: the engine takes its choice instead
    of the router's, an expert chosen twice included (computed twice, added in pair order, counted once)."""
    store = store_of("mixtral")
    calls = counted(monkeypatch, "step" if way == "step" else "moe")
    ours = decode(store, way, monkeypatch, routing=replayed)
    layers = len(ours[2]) // (2 * len(STEPS))   # the hooks saw two records a layer and step
    assert len(calls) == len(STEPS) * (1 if way == "step" else layers)
    same(ours, decode(store, "generic", monkeypatch, routing=replayed))


def test_the_step_starts_after_the_last_layer_it_cannot_compute(store_of):
    """DeepSeek's first layer is a dense MLP, which the step's kernel does not compute: its step starts
    at layer 1. A model whose every layer it computes starts at 0."""
    with edgemoe.load(store_of("deepseek_v2"), dense_bits=8, compute="fused-int", preload="none") as model:
        assert model.spec.moe_layers[0] is False and model.decode_engine.step_start == 1
        for entry in model.store.experts():
            model.store.get(*entry.key)
        assert model.experts.resident_step_layouts(1).shape[0] == model.spec.num_layers - 1
    with edgemoe.load(store_of("mixtral"), dense_bits=8) as model:
        assert model.decode_engine.step_start == 0


def test_where_a_step_cannot_run_whole_it_runs_layer_by_layer(store_of, monkeypatch):
    """A store still reading experts has no resident tables: its steps run without the one call."""
    steps = counted(monkeypatch, "step")
    with edgemoe.load(store_of("mixtral"), dense_bits=8, compute="fused-int", preload="none") as model:
        model.store.get(*next(iter(model.store.experts())).key)
        assert model.decode_engine.computes_token() and model.experts.resident_step_layouts() is None
        model.forward(torch.tensor([3]), [Segment(model.new_cache(), 1)])
    assert not steps


DEEPSEEK_ROUTERS = [("deepseek_v2", {}), ("deepseek_v2", {"routed_scaling_factor": 2.5}),
                    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2,
                                     "routed_scaling_factor": 2.5}),
                    ("deepseek_v3", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
                    ("deepseek_v3", {"dtype": "bfloat16"}),   # loaded as bfloat16, as --dtype auto on a BF16 CPU
                    ("deepseek_v2", {"kv_dtype": "bfloat16"})]   # a bfloat16 KV cache (the latent step's int16 view)


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("arch, overrides", DEEPSEEK_ROUTERS)
def test_deepseeks_moe_block_with_its_shared_experts_runs_in_one_call_with_the_generic_bits(store_of, monkeypatch,
                                                                                          path, arch, overrides):
    """DeepSeek's MoE layers (after latent attention and a first dense layer; ungated shared experts):
    V2's "greedy" softmax, its weights scaled or not, V2's group-limited softmax and V3's grouped
    sigmoid with its correction bias. The layers after the dense one in one call a step (the latent
    step kernel), or each MoE layer's block in one call after its attention block: the bits of the
    generic block after the same attention block (whose router is the same numba code, and which
    adds the shared expert by the same kernel)."""
    monkeypatch.setenv(INT_PATH_ENV, path)
    overrides = dict(overrides)
    options = {"kv_dtype": overrides.pop("kv_dtype")} if "kv_dtype" in overrides else {}
    store = store_of(arch, **overrides)
    if overrides.get("dtype") == "bfloat16":
        options["dtype"] = torch.bfloat16
    steps, moe_blocks = counted(monkeypatch, "step"), counted(monkeypatch, "moe")
    whole = decode(store, "step", monkeypatch, **options)
    assert len(steps) == len(STEPS) and not moe_blocks
    by_layer = decode(store, "layer", monkeypatch, **options)
    with edgemoe.load(store) as model:
        routed = sum(model.spec.moe_layers)
        assert model.spec.shared_expert_hidden and not model.spec.shared_expert_gated and routed < model.spec.num_layers
    assert len(moe_blocks) == len(STEPS) * routed
    generic = decode(store, "generic", monkeypatch, **options)
    assert len(moe_blocks) == len(STEPS) * routed and len(steps) == len(STEPS)
    same(whole, by_layer)
    same(whole, generic)
    assert whole[1][0] == len(STEPS) * routed * model.spec.top_k and whole[1][1] > 0


def test_a_shared_expert_is_computed_as_the_torch_block_computes_it(store_of):
    """The engine's shared expert (integer kernel, numba's sigmoid) against the generic block's torch
    path on the same quantized matrices: equal within float32 rounding, for a gated (qwen2_moe) and
    an ungated (deepseek_v2) one."""
    from edgemoe.layers import linear, swiglu
    for arch in ("qwen2_moe", "deepseek_v2"):
        with edgemoe.load(store_of(arch), dense_bits=8) as model:
            l = model.spec.moe_layers.index(True)
            w, engine = model.layers[l], model.decode_engine
            assert engine.computes_shared(l)
            h = torch.randn(1, model.spec.hidden_size)
            ours = torch.zeros(1, model.spec.hidden_size)
            engine.add_shared(l, h, ours)
            theirs = swiglu(h, w["shared.gate"], w["shared.up"], w["shared.down"])
            if model.spec.shared_expert_gated:
                theirs = torch.sigmoid(linear(h, w["shared_gate"])) * theirs
            assert ours.abs().max() > 0
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_a_ram_budget_that_holds_every_expert_is_filled_at_open(store_of, monkeypatch):
    """So that a run whose model fits decodes in the one-call step from its first token (experts read
    on first use might never all become resident); without a budget, or with placement off, experts
    are read on first use as before."""
    from edgemoe.store import open_store
    path = store_of("mixtral")
    with open_store(path, ram="100%") as store:
        assert store.holds_everything() and store.resident_tables() is not None
        assert store.stats.misses == 0 and store.stats.ram.hits == 0   # placement is no request
    with open_store(path, ram="100%", place_popular=False) as store, open_store(path) as unlimited:
        assert store.cache.count() == 0 and unlimited.cache.count() == 0
    steps = counted(monkeypatch, "step")
    with edgemoe.load(path, dense_bits=8, compute="fused-int", ram="100%") as model:
        model.forward(torch.tensor([3]), [Segment(model.new_cache(), 1)])
    assert steps


@pytest.mark.parametrize("router", ["sparsemixer", "topk_softmax", "softmax_group", "sigmoid_group",
                                    "sigmoid_group_normalized"])
def test_the_engines_numba_routers_choose_as_the_model_files_routers(router):
    """Phi-3.5-MoE's sparsemixer, GPT-OSS's top-k softmax and DeepSeek's group-limited routers in numba
    (the engine's) against their torch definitions (models/phimoe.py, models/gpt_oss.py,
    models/deepseek_v2.py, models/deepseek_v3.py): the same experts, weights within float32 rounding."""
    from types import SimpleNamespace
    from edgemoe.models.deepseek_v2 import GroupLimitedSoftmax
    from edgemoe.models.deepseek_v3 import SigmoidGroup
    from edgemoe.models.gpt_oss import TopKSoftmax
    from edgemoe.models.phimoe import SparseMixer

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits = torch.randn(1, 16, generator=g) * (0.1 if trial % 2 else 3)
        bias = torch.randn(16, generator=g)
        weights, experts = torch.empty(2), torch.empty(2, dtype=torch.long)
        if router == "sparsemixer":
            reference = SparseMixer(router_jitter_eps=0.05).choose(logits, None, SimpleNamespace(top_k=2))
            cpu_layer.sparsemixer_kernel(logits.numpy()[0], 0.05, weights.numpy(), experts.numpy())
        elif router != "topk_softmax":   # 16 experts in 4 groups, 2 kept (DeepSeek's ratio, scaled)
            weights, experts = torch.empty(3), torch.empty(3, dtype=torch.long)
            sigmoid, normalize = router != "softmax_group", router.endswith("normalized")
            kind = SigmoidGroup if sigmoid else GroupLimitedSoftmax
            reference = kind(n_group=4, topk_group=2).choose(logits, bias, SimpleNamespace(top_k=3, norm_topk_prob=normalize))
            cpu_layer.grouped_kernel(logits.numpy()[0], bias.numpy(), 4, 2, sigmoid, normalize, 3, weights.numpy(),
                                     experts.numpy())
        else:
            reference = TopKSoftmax().choose(logits, bias, SimpleNamespace(top_k=2))
            cpu_layer.topk_softmax_kernel(logits.numpy()[0], bias.numpy(), 2, weights.numpy(), experts.numpy())
        assert experts.tolist() == reference[1][0].tolist()
        assert torch.allclose(weights, reference[0][0], rtol=1e-6, atol=0)


def test_a_resident_step_leaves_the_preloader_out_and_decodes_as_without_it(store_of, monkeypatch):
    """With every expert resident the preloader has nothing to predict or read: the decode engine's
    steps (the whole token's call, or a layer's MoE block) do not call its hooks (each would return at
    once), decode the same bits and store counts as a model without a preloader, and still call
    every other hook (decode's own)."""
    from edgemoe.scheduling.preload import Preloader

    store = store_of("qwen3_moe", num_experts=16, num_experts_per_tok=8)
    calls = []
    monkeypatch.setattr(Preloader, "on_routing", lambda self, *args: calls.append("routing"))
    monkeypatch.setattr(Preloader, "on_moe_input", lambda self, *args: calls.append("input"))
    with edgemoe.load(store) as model:
        layers = len(model.spec.moe_layer_ids)
    steps = counted(monkeypatch, "step")
    with_preloader = decode(store, "step", monkeypatch, preload="lookahead")
    assert len(steps) == len(STEPS)
    assert calls.count("routing") == calls.count("input") == layers   # the prompt's pass only, not a step
    same(with_preloader, decode(store, "step", monkeypatch))
    calls.clear()
    decode(store, "generic", monkeypatch, preload="lookahead")   # StoreExperts.run's path calls them
    assert calls.count("routing") == calls.count("input") == layers * (1 + len(STEPS))
