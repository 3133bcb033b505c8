"""edgemoe's logits and greedy generation match transformers' own models, architecture by architecture.

Reference: transformers' AutoModelForCausalLM on the same checkpoint, float32. Decode steps through
our KV cache are compared with the reference's logits for the whole sequence at those positions.
"""

import pytest
import torch
import transformers

import edgemoe
from edgemoe import attention
from edgemoe.generate import GenerationOptions, generate_batch

TOL = 1e-4

CONFIGS = [
    ("mixtral", {}),
    ("mixtral", {"num_experts_per_tok": 1}),
    ("mixtral", {"num_key_value_heads": 4}),                                  # no GQA
    ("mixtral", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 60,
                 "intermediate_size": 37}),                                   # odd sizes, head_dim 10
    ("mixtral", {"sliding_window": 5}),                                       # window shorter than the text
    ("mixtral", {"tie_word_embeddings": True, "num_local_experts": 6, "num_experts_per_tok": 3}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"norm_topk_prob": True, "num_key_value_heads": 1}),
    ("qwen2_moe", {"mlp_only_layers": [0], "num_hidden_layers": 3}),
    ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3, "qkv_bias": False}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": True, "num_experts": 5, "num_experts_per_tok": 3}),
    ("qwen3_moe", {"num_experts_per_tok": 1, "mlp_only_layers": [1]}),
    ("olmoe", {}),
    ("olmoe", {"norm_topk_prob": True, "clip_qkv": 0.5}),
    ("olmoe", {"num_experts_per_tok": 1, "num_key_value_heads": 1}),
    ("deepseek_v2", {}),                                                      # V2-Lite: plain q projection
    ("deepseek_v2", {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2,
                     "routed_scaling_factor": 1.5}),
    ("deepseek_v2", {"attention_bias": True, "first_k_dense_replace": 0, "num_experts_per_tok": 1}),
    ("deepseek_v3", {}),                                                      # q latent, 4 groups keep 2
    ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None, "norm_topk_prob": False}),
    ("deepseek_v3", {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 3, "first_k_dense_replace": 2,
                     "attention_bias": True}),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 4,
                                         "beta_slow": 1, "original_max_position_embeddings": 64, "mscale": 1.0,
                                         "mscale_all_dim": 0.8}}),           # rotary dims 0-3 blended
    ("deepseek_v2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 0.707, "mscale_all_dim": 0.707}}),   # transformers 4 spelling
    ("phimoe", {}),                                                           # attention and LM-head biases
    ("phimoe", {"attention_bias": False, "lm_head_bias": False, "sliding_window": 5}),
    ("phimoe", {"tie_word_embeddings": True, "num_key_value_heads": 1, "router_jitter_noise": 0.2}),
    ("gpt_oss", {}),                                   # window 4 on layer 0: the 13 tokens reach past it
    ("gpt_oss", {"mxfp4": True}),                      # MXFP4 experts, which transformers dequantizes itself
    ("gpt_oss", {"swiglu_limit": 0.3, "swiglu_alpha": 1.2, "num_key_value_heads": 1, "num_experts_per_tok": 3,
                 "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 3,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 8.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}}),
    ("gpt_oss", {"attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
]
ARCHITECTURES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "phimoe", "gpt_oss"]


SHORT, LONG = [1.0 + 0.25 * i for i in range(8)], [1.5 + 0.5 * i for i in range(8)]


def longrope(short, long, short_mscale, long_mscale, original):
    return {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short,
                                "long_factor": long, "short_mscale": short_mscale, "long_mscale": long_mscale,
                                "original_max_position_embeddings": original}}


CONFIGS.append(("phimoe", longrope(SHORT, LONG, 1.1, 1.3, 64)))   # Phi-3.5-MoE's rotary, within its original context


def test_longrope_past_the_original_context_uses_the_long_factors(tiny_model):
    """A step reaching past original_max_position_embeddings rotates by the long factors and mscale,
    as Phi-3.5-MoE's own code does (transformers' port keeps the short factors there): compared with
    transformers on the same weights configured with the long set as its short one."""
    ours = edgemoe.load(tiny_model("phimoe", **longrope(SHORT, LONG, 1.1, 1.3, 10)))
    long_as_short = reference(tiny_model("phimoe", **longrope(LONG, LONG, 1.3, 1.3, 64)))
    short = reference(tiny_model("phimoe", **longrope(SHORT, SHORT, 1.1, 1.1, 64)))
    tokens = random_tokens(13, ours.spec.vocab_size)
    with torch.no_grad():
        past, within = long_as_short(tokens[None]).logits[0], short(tokens[None, :10]).logits[0]
    assert (ours.logits(tokens) - past).abs().max() <= TOL            # 13 positions > 10: the long set
    assert (ours.logits(tokens[:10]) - within).abs().max() <= TOL     # 10 positions: the short set
    assert (past[:10] - within).abs().max() > 100 * TOL               # the two sets differ


def _ids(config):
    arch, overrides = config
    return "-".join([arch] + [f"{k}={v}" for k, v in overrides.items()])


def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def random_tokens(n, vocab, seed=1):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch,overrides", CONFIGS, ids=[_ids(c) for c in CONFIGS])
def test_prefill_and_decode_logits_match_transformers(tiny_model, arch, overrides):
    path = tiny_model(arch, **overrides)
    ref, ours = reference(path), edgemoe.load(path)
    tokens = random_tokens(13, ours.spec.vocab_size)
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0]                     # [T, V]
    cache = ours.new_cache()
    prefill = ours.logits(tokens[:9], cache)
    decode = torch.cat([ours.logits(tokens[t:t + 1], cache) for t in range(9, 13)])
    assert prefill.dtype == torch.float32 and prefill.shape == (9, ours.spec.vocab_size)
    assert (prefill - expected[:9]).abs().max() <= TOL
    assert (decode - expected[9:]).abs().max() <= TOL
    assert cache.length == 13


@pytest.mark.parametrize("absorbed", [True, False])
@pytest.mark.parametrize("arch, overrides", [("deepseek_v2", {}), ("deepseek_v3", {"kv_lora_rank": 48})])
def test_latent_attention_matches_transformers_absorbed_and_expanded(tiny_model, monkeypatch, arch, overrides, absorbed):
    """Both forms of attention over the latent cache (edgemoe.attention.mla_attend), each forced for
    prefill and decode alike: the tiny configs' costs alone would absorb every step."""
    monkeypatch.setattr(attention, "absorbs", lambda spec, tokens: absorbed)
    test_prefill_and_decode_logits_match_transformers(tiny_model, arch, overrides)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_generation_matches_transformers_generate(tiny_model, arch):
    path = tiny_model(arch)
    ref, ours = reference(path), edgemoe.load(path)
    prompt = ours.tokenizer.encode("Now is the winter")
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    eos = ours.tokenizer.eos_token_id
    expected = out[:out.index(eos)] if eos in out else out
    generated = generate_batch(ours, [prompt], GenerationOptions(max_new_tokens=20))
    assert generated[0] == expected


@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "deepseek_v3"])
def test_fused_and_sharded_checkpoints_load_to_the_same_model(tiny_model, arch):
    # One thread each: bit equality needs the same summation order, which a thread count following
    # the machine's load would change between two loads.
    plain = edgemoe.load(tiny_model(arch), threads=1)
    tokens = random_tokens(7, plain.spec.vocab_size)
    expected = plain.logits(tokens)
    for variant in (dict(fused_experts=True), dict(shards=3), dict(fused_experts=True, shards=2)):
        model = edgemoe.load(tiny_model(arch, **variant), threads=1)
        assert torch.equal(model.logits(tokens), expected), variant


def test_bfloat16_checkpoint_matches_transformers_in_float32(tiny_model):
    path = tiny_model("qwen2_moe", dtype="bfloat16")
    ref, exact = reference(path), edgemoe.load(path, dtype=torch.float32)
    default = edgemoe.load(path, dtype=torch.bfloat16)
    tokens = random_tokens(10, exact.spec.vocab_size)
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0]
    assert (exact.logits(tokens) - expected).abs().max() <= TOL
    # Kept bfloat16, matrices are multiplied in bfloat16 (accumulated in float32), vectors and
    # activations float32: the logits differ by bfloat16 rounding of the activations (measured: max
    # 0.9-1.4% of the largest logit, KL 3-4e-5 on tiny qwen2_moe and mixtral models).
    assert default.layers[0]["q"].dtype == torch.bfloat16 and default.layers[0]["attn_norm"].dtype == torch.float32
    got = default.logits(tokens)
    assert got.dtype == torch.float32 and (got - expected).abs().max() <= 0.03 * expected.abs().max()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl <= 1e-3


def test_bundled_model_matches_transformers():
    from edgemoe.bundled import bundled_model_path, bundled_text

    path = bundled_model_path()        # bfloat16 weights: transformers computes in float32, as dtype=float32 does
    ref, ours = reference(path), edgemoe.load(path, dtype=torch.float32)
    text = bundled_text("eval.txt").read_text()[:3000]
    tokens = torch.tensor(ours.tokenizer.encode(text))[:160]
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0]
    cache = ours.new_cache()
    got = torch.cat([ours.logits(tokens[:150], cache)] + [ours.logits(tokens[t:t + 1], cache) for t in range(150, 160)])
    assert (got - expected).abs().max() <= TOL
    default = edgemoe.load(path, dtype=torch.bfloat16).logits(tokens)   # bfloat16 rounding only
    kl = torch.nn.functional.kl_div(default.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl <= 1e-3 and (default.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.95


def test_auto_precision_keeps_bfloat16_only_where_the_cpu_computes_it(tiny_model, monkeypatch):
    from edgemoe import precision
    path = tiny_model("qwen2_moe", dtype="bfloat16")
    for native, expected in ((frozenset(), torch.float32), (frozenset({torch.bfloat16}), torch.bfloat16)):
        monkeypatch.setattr(precision, "native_types", lambda native=native: native)
        model = edgemoe.load(path)
        assert model.layers[0]["q"].dtype == expected and model.embed.dtype == expected
        assert model.experts.expert(1, 0).weights["gate"].dtype == expected
    assert edgemoe.load(path, dtype=torch.bfloat16).layers[0]["q"].dtype == torch.bfloat16   # explicit wins
