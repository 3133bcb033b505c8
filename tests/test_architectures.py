"""Architecture-specific pieces on their own: the routers against transformers' own modules on many
tokens, DeepSeek's MoE-layer rule, multi-token prediction tensors skipped, and the configurations we
refuse (one error naming config.json and the field)."""

import json
import math
import shutil
from dataclasses import MISSING, fields

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import edgemoe
from edgemoe.errors import CheckpointError
from edgemoe.layers import route_by_spec
from edgemoe.models import deepseek_v2
from edgemoe.spec import PARTS, ModelSpec

D = 32

ROUTER_CASES = [
    ("deepseek_v2", dict(n_routed_experts=12, num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=1.7)),
    ("deepseek_v2", dict(n_routed_experts=12, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, routed_scaling_factor=16.0)),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=8, topk_group=3, norm_topk_prob=False)),
    ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2)),
    ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.3)),
    ("gpt_oss", dict(num_local_experts=16, num_experts_per_tok=4, num_hidden_layers=1)),
]


def transformers_router(arch, overrides):
    """transformers' router module of `arch`, with random weights (and correction bias), and its config."""
    config = transformers.AutoConfig.for_model(arch, hidden_size=D, num_attention_heads=4, num_key_value_heads=4,
                                               **overrides)
    module = {"deepseek_v2": "DeepseekV2TopkRouter", "deepseek_v3": "DeepseekV3TopkRouter",
              "phimoe": "PhimoeTopKRouter", "gpt_oss": "GptOssTopKRouter"}[arch]
    router = getattr(getattr(transformers.models, arch), f"modeling_{arch}").__dict__[module](config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if arch == "deepseek_v3":
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.e_score_correction_bias.shape, generator=g))
        if arch == "gpt_oss":   # a logit bias
            router.bias.copy_(torch.randn(router.bias.shape, generator=g))
    return router, config


@pytest.mark.parametrize("arch,overrides", ROUTER_CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(ROUTER_CASES)])
def test_routers_match_transformers_on_many_tokens(arch, overrides):
    router, config = transformers_router(arch, overrides)
    spec_fields = edgemoe.models.architecture(arch).parse_config(
        {**config.to_dict(), "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8,
         "moe_intermediate_size": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
         "v_head_dim": 4})
    x = torch.randn(500, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ref_weights, ref_experts = router(x)
    bias = {"deepseek_v3": getattr(router, "e_score_correction_bias", None),
            "gpt_oss": getattr(router, "bias", None)}.get(arch)
    weights, experts = route_by_spec(x, router.weight.detach(), bias, spec_fields)
    # transformers returns the top-k unsorted: compare each token's experts and weights by expert id
    ref_order, order = ref_experts.argsort(dim=-1), experts.argsort(dim=-1)
    assert torch.equal(ref_experts.gather(1, ref_order), experts.gather(1, order))
    assert torch.allclose(ref_weights.gather(1, ref_order), weights.gather(1, order), atol=1e-6)


def test_deepseek_moe_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    config = {"first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert deepseek_v2.moe_layer_flags(config, 6) == (False, False, True, False, True, False)
    assert deepseek_v2.moe_layer_flags({"first_k_dense_replace": 3}, 5) == (False, False, False, True, True)


@pytest.fixture
def copy_of(tiny_model, tmp_path):
    def make(arch, **overrides):
        path = tmp_path / arch
        shutil.copytree(tiny_model(arch, **overrides), path)
        return path
    return make


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_multi_token_prediction_layers_are_skipped_and_nothing_else(copy_of):
    path = copy_of("deepseek_v3")
    expected = edgemoe.load(path).logits([5, 6, 7])
    tensors = load_file(path / "model.safetensors")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    edit_config(path, num_nextn_predict_layers=1)
    assert torch.equal(edgemoe.load(path).logits([5, 6, 7]), expected)
    edit_config(path, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match=rf"unused tensors model\.layers\.{layers}\.eh_proj\.weight"):
        edgemoe.load(path)


@pytest.mark.parametrize("arch,changes,message", [
    ("deepseek_v2", {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling type 'dynamic' is not supported"),
    ("phimoe", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                    "long_factor": [1.0] * 7, "original_max_position_embeddings": 16}},
     "long_factor must list 8 numbers"),
    ("phimoe", {"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "rope_parameters type 'su' is not supported"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=true is not supported for deepseek_v2"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias=true is not supported"),
    ("deepseek_v3", {"n_group": 3}, "n_group=3 does not divide 8 experts"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 1}, "n_group=8 leaves fewer than 2 experts per group"),
    ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok=3 exceeds the 2 experts"),
    ("phimoe", {"num_experts_per_tok": 3}, "sparsemixer routing picks 2 experts"),
    ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8' is not supported"),
    ("gpt_oss", {"layer_types": ["sliding_attention"]}, "layer_types lists 1 layers, num_hidden_layers is 2"),
    ("gpt_oss", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types: 'chunked_attention'"),
])
def test_unsupported_configurations_name_config_json_and_the_field(copy_of, arch, changes, message):
    path = copy_of(arch)
    edit_config(path, **changes)
    with pytest.raises(CheckpointError, match="config.json: .*" + message.replace("(", r"\(")) as info:
        edgemoe.load(path)
    assert "\n" not in str(info.value)


def test_spec_round_trips_through_a_store_manifest(tiny_model):
    spec = edgemoe.load(tiny_model("deepseek_v3")).spec
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# One checkpoint per router kind, its parameters away from their defaults where it has any.
ROUTER_KINDS = {"softmax": ("mixtral", {}),
                "softmax_group": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=3, topk_group=2)),
                "sigmoid_group": ("deepseek_v3", {}),
                "sparsemixer": ("phimoe", dict(router_jitter_noise=0.3)),
                "topk_softmax": ("gpt_oss", {})}
# The router and expert-kind parameters a manifest written before these kinds moved into the architecture
# files held for every model, with their defaults then (ModelSpec's n_group, topk_group,
# router_jitter_eps, swiglu_alpha and swiglu_limit).
EARLIER_KIND_KEYS = {"n_group": 1, "topk_group": 1, "router_jitter_eps": 0.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def test_every_router_kind_registered_has_a_checkpoint_here():
    assert set(ROUTER_KINDS) == set(edgemoe.models.KINDS["router"])


@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_each_router_is_its_kind_and_parameters_in_the_manifest(tiny_model, kind):
    arch, overrides = ROUTER_KINDS[kind]
    config = json.loads((tiny_model(arch, **overrides) / "config.json").read_text())
    spec = edgemoe.models.parse_spec(config)
    written = json.loads(json.dumps(spec.to_dict()))
    assert written["router"] == kind == spec.router and "routing" not in written
    assert {name for name in EARLIER_KIND_KEYS if name in written} == {
        name for name in EARLIER_KIND_KEYS if hasattr(spec.routing, name) or hasattr(spec.expert_kind, name)}
    assert ModelSpec.from_dict(written) == spec


@pytest.mark.parametrize("arch, kind, roles", [("mixtral", "swiglu", ("gate", "up", "down")),
                                               ("gpt_oss", "gpt_oss", ("gate", "up", "down")),
                                               ("switch_transformers", "relu", ("up", "down"))])
def test_each_expert_kind_is_its_name_roles_and_parameters_in_the_manifest(tiny_model, arch, kind, roles):
    overrides = {"swiglu_limit": 0.5} if arch == "gpt_oss" else {}
    config = json.loads((tiny_model(arch, **overrides) / "config.json").read_text())
    spec = edgemoe.models.parse_spec(config)
    written = json.loads(json.dumps(spec.to_dict()))
    assert written["expert_activation"] == kind == spec.expert_activation and "expert_kind" not in written
    assert spec.expert_roles == roles and ModelSpec.from_dict(written) == spec
    assert ("swiglu_limit" in written) == (kind == "gpt_oss") and written.get("swiglu_limit", 0.5) == 0.5
    assert set(edgemoe.models.KINDS["expert_activation"]) == {"swiglu", "gpt_oss", "relu"}


# The parts whose kinds their architecture files declare beside the router and the expert kind: per
# manifest key, one checkpoint per kind, and the fields a manifest written before these parts held for
# every model (their defaults then where a model had no use for them), without the key ("attention"
# was written already).
PART_KINDS = {
    "rope_type": {"default": ("mixtral", {}),
                  "yarn": ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                               "original_max_position_embeddings": 64}}),
                  "longrope": ("phimoe", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                                              "short_factor": [1.5] * 8, "long_factor": [3.0] * 8,
                                                              "short_mscale": 1.1, "long_mscale": 1.3,
                                                              "original_max_position_embeddings": 32}})},
    "attention": {"gqa": ("mixtral", {}), "mla": ("deepseek_v3", {})},
    "stacks": {"decoder": ("mixtral", {}), "encoder_decoder": ("switch_transformers", {})},
}
EARLIER_PART_KEYS = {
    "rope_type": {"rope_inv_freq": None, "rope_attention_factor": 1.0, "rope_long_after": None,
                  "rope_long_inv_freq": None, "rope_long_attention_factor": 1.0},
    "attention": {"q_lora_rank": 0, "kv_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0},
    "stacks": {"encoder_layers": 0, "relative_attention_buckets": 0, "relative_attention_max_distance": 0,
               "decoder_start_token_id": None, "expert_capacity": None},
}


@pytest.mark.parametrize("key, kind", [(key, kind) for key, kinds in PART_KINDS.items() for kind in kinds])
def test_each_part_kind_is_its_name_and_parameters_in_the_manifest_and_reads_as_written_before(tiny_model, key, kind):
    assert set(PART_KINDS[key]) == set(edgemoe.models.KINDS[key])
    arch, overrides = PART_KINDS[key][kind]
    spec = edgemoe.models.parse_spec(json.loads((tiny_model(arch, **overrides) / "config.json").read_text()))
    part = next(getattr(spec, name) for name in PARTS if getattr(spec, name).key == key)
    written = json.loads(json.dumps(spec.to_dict()))
    assert written[key] == kind == part.kind
    earlier = EARLIER_PART_KEYS[key]
    assert set(earlier) & set(written) == set(earlier) & {f.name for f in fields(part)}   # only its kind's
    assert ModelSpec.from_dict(written) == spec
    before = {**earlier, **{k: v for k, v in written.items() if k != key or key == "attention"}}
    assert ModelSpec.from_dict(before) == spec
    for name in {f.name for f in fields(part) if f.default is MISSING}:   # the kind's own parameters
        with pytest.raises(TypeError, match=name):
            ModelSpec.from_dict({k: v for k, v in written.items() if k != name})


# Each family's attention quirks, as its architecture file sets them on its attention part (the rest
# at Llama's defaults: no biases, norms, clipping or sinks, softmax scale 1/sqrt(key dims)).
ATTENTION_QUIRKS = {
    "mixtral": ({}, {}),
    "qwen2_moe": ({}, dict(qkv_bias=True)),
    "qwen3_moe": ({}, dict(qk_norm="head")),
    "olmoe": ({"clip_qkv": 0.5}, dict(qk_norm="proj", clip_qkv=0.5)),
    "phimoe": ({"attention_bias": True}, dict(qkv_bias=True, o_bias=True)),
    # YaRN (transformers' default for GPT-OSS) sets the scale: without mscale_all_dim, 1/sqrt(head_dim 16)
    "gpt_oss": ({}, dict(qkv_bias=True, o_bias=True, attention_sinks=True, attention_scale=0.25)),
    "deepseek_v2": ({"attention_bias": True}, dict(qkv_bias=True, o_bias=True)),
    "switch_transformers": ({}, dict(attention_scale=1.0)),
}
ATTENTION_DEFAULTS = dict(qkv_bias=False, qk_norm=None, clip_qkv=None, o_bias=False, attention_scale=None,
                          attention_sinks=False)


@pytest.mark.parametrize("arch", ATTENTION_QUIRKS)
def test_attention_quirks_are_the_attention_parts_and_keep_their_manifest_keys(tiny_model, arch):
    """The architecture file sets its quirks on its attention part (ModelSpec has no field for them), and
    a manifest holds them under the keys it always did, beside "attention"."""
    overrides, quirks = ATTENTION_QUIRKS[arch]
    spec = edgemoe.models.parse_spec(json.loads((tiny_model(arch, **overrides) / "config.json").read_text()))
    expected = {**ATTENTION_DEFAULTS, **quirks}
    assert {name: getattr(spec.attention, name) for name in ATTENTION_DEFAULTS} == expected
    assert not set(ATTENTION_DEFAULTS) & {f.name for f in fields(ModelSpec)}
    written = json.loads(json.dumps(spec.to_dict()))
    assert {name: written[name] for name in ATTENTION_DEFAULTS} == expected
    assert ModelSpec.from_dict(written) == spec


def test_a_yarn_softmax_scale_is_on_the_attention_part(tiny_model):
    """DeepSeek's YaRN multiplies the softmax scale by mscale(factor, mscale_all_dim)^2: 0.1 ln 4 + 1."""
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64}
    spec = edgemoe.models.parse_spec(json.loads((tiny_model("deepseek_v3", rope_parameters=rope)
                                                 / "config.json").read_text()))
    expected = spec.key_dim ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2
    assert spec.attention.attention_scale == pytest.approx(expected, rel=1e-12)
    assert spec.attention.softmax_scale(spec) == spec.attention.attention_scale


@pytest.mark.parametrize("kind", ["softmax", "sigmoid_group", "sparsemixer", "topk_softmax"])
def test_a_store_written_before_the_kinds_moved_loads_as_it_did(tiny_model, tmp_path, kind):
    """A manifest that lists every router kind's and expert kind's parameters (as every store written
    before held them) loads the same router and experts with their own parameters, and the same logits."""
    from edgemoe.convert import convert
    from edgemoe.store.format import MANIFEST

    arch, overrides = ROUTER_KINDS[kind]
    convert(tiny_model(arch, **overrides), tmp_path / "s", bits=4)
    with edgemoe.load(tmp_path / "s", compute="fused-float") as model:
        spec, expected = model.spec, model.logits([5, 6, 7, 8])
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    earlier = {**EARLIER_KIND_KEYS, **manifest["spec"]}
    assert set(earlier) != set(manifest["spec"])
    (tmp_path / "s" / MANIFEST).write_text(json.dumps({**manifest, "spec": earlier}))
    with edgemoe.load(tmp_path / "s", compute="fused-float") as model:
        assert model.spec == spec and model.spec.routing == spec.routing and model.spec.expert_kind == spec.expert_kind
        assert torch.equal(model.logits([5, 6, 7, 8]), expected)


@pytest.mark.parametrize("arch, key, value, message", [
    ("mixtral", "router", "noaux_tc", "router='noaux_tc': expected one of softmax,"),
    ("qwen3_moe", "qk_norm", "layer", r"qk_norm='layer' \(expected one of \(None, 'head', 'proj'\)\)"),
])
def test_a_manifest_naming_an_unknown_kind_is_refused_in_one_line(tiny_model, tmp_path, arch, key, value, message):
    from edgemoe.convert import convert
    from edgemoe.store import StoreError
    from edgemoe.store.format import MANIFEST

    convert(tiny_model(arch), tmp_path / "s", bits=4)
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    manifest["spec"][key] = value
    (tmp_path / "s" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"manifest.json: spec: .*" + message) as info:
        edgemoe.load(tmp_path / "s")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("arch", ["phimoe", "deepseek_v3", "gpt_oss"])
def test_a_twin_built_from_dense_weights_is_the_same_model(tiny_model, arch):
    """The budget search builds its quantized twin from dense_weights(): every bias and norm must come along."""
    from edgemoe.model import MoEModel

    model = edgemoe.load(tiny_model(arch))
    twin = MoEModel(model.spec, model.dense_weights(), model.experts)
    assert set(model.dense_weights()) == set(model.spec.dense_shapes())
    assert torch.equal(twin.logits([5, 6, 7, 8]), model.logits([5, 6, 7, 8]))
