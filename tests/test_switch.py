"""Switch Transformers (encoder-decoder): Seq2SeqModel against transformers' own model (encoder output,
decoder logits of a pass and of cached steps, greedy generation), ungated relu experts on every
compute path of a store against plain torch, and the clear refusals of what is decoder-only."""

import functools
import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers

import edgemoe
from edgemoe.convert import QualityBudget, convert, pipeline
from edgemoe.convert.budget import MIN_SAMPLE_WINDOWS, spread
from edgemoe.loader import StoreOptions
from edgemoe.store import read_manifest
from edgemoe.errors import CheckpointError
from edgemoe.experts import DenseExpert, InMemoryExperts
from edgemoe.generate import GenerationOptions, stream_tokens
from edgemoe.kernels import qmatmul, qmatmul_int
from edgemoe.kernels.activations import relu_expert
from edgemoe.kernels.reference import relu_expert_reference, relu_int_twin
from edgemoe.quant import dequantize_reference, quantize
from edgemoe.seq2seq import Seq2SeqModel
from edgemoe.store import StoreError
from edgemoe.store.format import MANIFEST
from edgemoe.store.profile_file import load_routing_profile

from helpers import acts, run_cli, weights

PROMPT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings"
DECODER_IDS = [2, 5, 17, 40, 99, 3, 7, 211, 64]


def switch(tiny_model, **overrides):
    return tiny_model("switch_transformers", **overrides)


def hf_model(path):
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()


def hf_cached_steps(hf, input_ids, decoder_ids):
    """transformers' decoder logits [T, V], one cached step per token (as its generate runs)."""
    encoder_outputs = hf.get_encoder()(input_ids=torch.tensor([input_ids]))
    past, rows = None, []
    for token in decoder_ids:
        out = hf(encoder_outputs=encoder_outputs, decoder_input_ids=torch.tensor([[token]]),
                 past_key_values=past, use_cache=True)
        past = out.past_key_values
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


CONFIGS = {
    "tied": {},
    "untied": {"tie_word_embeddings": False},
    # An expert takes at most 2 tokens of a pass: most of the prompt's tokens in MoE layers are dropped.
    "capacity": {"expert_capacity": 2},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@torch.no_grad()
def test_matches_transformers_encoder_pass_and_cached_steps(tiny_model, config):
    path = switch(tiny_model, **CONFIGS[config])
    hf, model = hf_model(path), edgemoe.load(path)
    assert isinstance(model, Seq2SeqModel)
    assert model.spec.moe_layers == tuple(block.layer[-1].is_sparse for stack in (hf.encoder, hf.decoder)
                                          for block in stack.block)
    ids = model.tokenizer.encode(PROMPT)
    expected = hf.get_encoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]
    assert (model.encode(ids) - expected).abs().max() <= 1e-4
    full_pass = hf(input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([DECODER_IDS])).logits[0]
    assert (model.logits(ids, DECODER_IDS) - full_pass).abs().max() <= 1e-4
    state = model.start(model.encode(ids))
    steps = torch.cat([model.decode([t], state) for t in DECODER_IDS])
    assert (steps - hf_cached_steps(hf, ids, DECODER_IDS)).abs().max() <= 1e-4


def test_capacity_drops_tokens_like_transformers(tiny_model):
    """The capacity configuration really drops tokens: without the limit the encoder's output changes."""
    path = switch(tiny_model, expert_capacity=2)
    model = edgemoe.load(path)
    ids = model.tokenizer.encode(PROMPT)
    spec = replace(model.spec, stacks=replace(model.spec.stacks, expert_capacity=None))
    unlimited = Seq2SeqModel(spec, model_dense(model), model.experts)
    assert (model.encode(ids) - unlimited.encode(ids)).abs().max() > 1e-2


def model_dense(model):
    dense = {"embed": model.embed, "enc_norm": model.enc_norm, "norm": model.final_norm}
    for l, layer in enumerate(model.layers):
        dense.update({f"layers.{l}.{name}": t for name, t in layer.items()})
    return dense


@pytest.mark.parametrize("config", ["tied", "untied"])
def test_greedy_generation_equals_transformers_generate(tiny_model, config):
    path = switch(tiny_model, **CONFIGS[config])
    hf, model = hf_model(path), edgemoe.load(path)
    ids = model.tokenizer.encode(PROMPT)
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0].tolist()
    assert expected[0] == model.spec.stacks.decoder_start_token_id
    ours = list(stream_tokens(model, ids, GenerationOptions(max_new_tokens=24)))
    eos = model.generation_config["eos_token_id"]
    assert ours == [t for t in expected[1:] if t != eos]
    assert len(ours) > 5


def test_relu_expert_on_packed_weights_matches_plain_torch():
    up, down = quantize(weights(96, 64, seed=3), 4), quantize(weights(64, 96, seed=4), 4)
    x = acts(5, 64)
    weights_of = {"up": up, "down": down}

    def through(kernel):
        return lambda h, role: torch.from_numpy(kernel(h.contiguous().numpy(), weights_of[role]))

    got = relu_expert(torch.from_numpy(x), through(qmatmul)).numpy()
    np.testing.assert_allclose(got, relu_expert_reference(x, up, down), rtol=1e-5, atol=1e-5)
    got_int = relu_expert(torch.from_numpy(x), through(qmatmul_int)).numpy()
    np.testing.assert_allclose(got_int, relu_int_twin(x, up, down), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def store(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("switch-stores") / "q4"
    convert(switch(tiny_model), out, bits=4)
    return out


def dequantized_reference(path, bits):
    """The checkpoint's model, every expert quantized then dequantized by plain torch."""
    model = edgemoe.load(path)
    model.experts = InMemoryExperts({
        key: DenseExpert(**{role: dequantize_reference(quantize(w, bits)) for role, w in e.weights.items()},
                         activation=relu_expert)
        for key, e in model.experts.experts.items()})
    return model


@pytest.mark.parametrize("compute, vram", [("fused-float", None), ("dequant", None),
                                           ("device", "100%"),    # every expert resident on the device
                                           ("device", "10%")])    # most copied over from RAM per use
def test_store_matches_dequantized_reference(tiny_model, store, compute, vram, vram_device):
    options = {"vram": vram, "device": vram_device} if vram else {}
    model = edgemoe.load(store, compute=compute, **options)
    reference = dequantized_reference(switch(tiny_model), 4)
    ids = model.tokenizer.encode(PROMPT)
    assert (model.logits(ids, DECODER_IDS) - reference.logits(ids, DECODER_IDS)).abs().max() <= 1e-4
    opts = GenerationOptions(max_new_tokens=16)
    assert list(stream_tokens(model, ids, opts)) == list(stream_tokens(reference, ids, opts))
    assert {role for entry in model.store.manifest.experts.values() for role in entry.tensors} == {"up", "down"}
    model.close()


def test_store_integer_path_generates_close_to_reference(tiny_model, store):
    """int8 activations move the logits a little (tests/test_int_kernels.py bounds the kernels)."""
    model = edgemoe.load(store, compute="fused-int")
    reference = dequantized_reference(switch(tiny_model), 4)
    ids = model.tokenizer.encode(PROMPT)
    got, expected = model.logits(ids, DECODER_IDS), reference.logits(ids, DECODER_IDS)
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()
    model.close()


def test_run_command_generates_from_store(tiny_model, store, monkeypatch, capsys):
    reference = dequantized_reference(switch(tiny_model), 4)
    expected = reference.generate(PROMPT, max_new_tokens=12)
    # The float kernels: by default the latency model, measured at run time, chooses each expert's
    # path, and the integer one (int8 activations) can part from the float reference at a near-tie
    # (seen once in a full run on a 2-core machine).
    # Dense matrices as stored (a command's default quantizes them: tests/test_seq2seq_engine.py).
    monkeypatch.setattr("sys.argv", ["edgemoe", "run", str(store), "-p", PROMPT, "-n", "12",
                                     "--temperature", "0", "--compute", "fused-float", "--dense-bits", "none"])
    capsys.readouterr()
    from edgemoe.cli import main
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, None)
    assert capsys.readouterr().out == PROMPT + expected + "\n"


@pytest.mark.parametrize("args, words", [
    (["eval", "{store}", "--text", "{text}"], "edgemoe eval"),
    (["run", "{store}", "-p", "hi", "--beams", "2"], "--beams"),
    (["serve", "{store}"], "serving"),
])
def test_decoder_only_commands_refuse_clearly(store, tmp_path, monkeypatch, capsys, args, words):
    text = tmp_path / "t.txt"
    text.write_text(PROMPT)
    status, err = run_cli(monkeypatch, capsys, *[a.format(store=store, text=text) for a in args])
    assert status != 0
    assert words in err and "encoder-decoder switch_transformers" in err


def test_calibration_text_profiles_both_stacks_apart(tiny_model, tmp_path, monkeypatch):
    """convert --calib: the routing profile covers the MoE layers of both stacks, counted from the
    encoder's routing of each window's first half and the decoder's of its teacher-forced second half,
    with no layer-to-layer count from an encoder layer into a decoder layer."""
    text = " ".join([PROMPT] * 4)
    # The profile is the store's own routing: both runs on the float path ("auto" chooses by timing).
    monkeypatch.setattr(pipeline, "StoreOptions", functools.partial(StoreOptions, compute="fused-float"))
    convert(switch(tiny_model), tmp_path / "s", bits=4, calib_text=text)
    model = edgemoe.load(tmp_path / "s", preload="none", compute="fused-float")
    spec = model.spec
    profile = load_routing_profile(tmp_path / "s")
    assert profile.moe_layers == spec.moe_layer_ids
    encoder_moe = [l for l in spec.moe_layer_ids if l < spec.stacks.encoder_layers]
    decoder_moe = [l for l in spec.moe_layer_ids if l >= spec.stacks.encoder_layers]
    assert len(encoder_moe) >= 2 and decoder_moe
    # Independently: each window's two passes through the store's model, routing seen by a plain hook.
    ids = torch.tensor(model.tokenizer.encode(text, add_special_tokens=False))
    context = min(model.context_length, 1024)
    expected = {l: [0] * spec.num_experts for l in spec.moe_layer_ids}
    model.add_routing_hook(lambda l, experts, *rest: [expected[l].__setitem__(e, expected[l][e] + 1)
                                                          for e in experts[:, 0].tolist()])
    encoder_tokens = 0
    for start in range(0, ids.numel(), context):
        window = ids[start:start + context]
        half = window.numel() // 2
        model.logits(window[:half], [spec.stacks.decoder_start_token_id, *window[half:-1].tolist()])
        encoder_tokens += half
    assert profile.counts == expected
    assert profile.given_prev[decoder_moe[0]] == {}      # nothing before it in its own stack
    assert sum(seen for seen, _ in profile.given_prev[encoder_moe[1]].values()) == encoder_tokens


BUDGET_TEXT = (" ".join([PROMPT] * 3) + " Whether 'tis nobler to take arms against a sea of troubles, and by "
               "opposing end them. To die, to sleep; no more; and by a sleep to say we end the heart-ache.") * 3


def hf_with_widths(path, widths):
    """transformers' model with each expert quantized at its width and dequantized by plain torch."""
    hf = hf_model(path)
    encoder_layers = hf.config.num_layers
    with torch.no_grad():
        for name, param in hf.named_parameters():
            match = re.fullmatch(r"(encoder|decoder)\.block\.(\d+)\.layer\.\d+\.mlp\.experts\.expert_(\d+)\.w[io]\.weight", name)
            if match:
                layer = int(match[2]) + (encoder_layers if match[1] == "decoder" else 0)
                param.copy_(dequantize_reference(quantize(param.detach().clone(), widths[layer, int(match[3])])))
    return hf


def hf_relative_ppl(path, widths, ids, context, keep=None):
    """transformers' ppl_quantized / ppl_reference - 1 over text-to-text windows of `context` tokens:
    each window's second half as labels given its first half (transformers teacher-forces labels);
    keep: only the windows of these indices."""
    windows = [ids[i:i + context] for i in range(0, len(ids), context) if len(ids) - i >= 2]
    windows = windows if keep is None else [windows[i] for i in keep]

    def summed_nll(hf):
        total = 0.0
        for window in windows:
            half = len(window) // 2
            out = hf(input_ids=torch.tensor([window[:half]]), labels=torch.tensor([window[half:]]))
            total += out.loss.item() * (len(window) - half)
        return total

    targets = sum(len(w) - len(w) // 2 for w in windows)
    return math.exp((summed_nll(hf_with_widths(path, widths)) - summed_nll(hf_model(path))) / targets) - 1


@torch.no_grad()
def test_budget_search_widths_and_loss_match_transformers(tiny_model, tmp_path, monkeypatch):
    """convert --budget on a Switch model: mixed widths within the budget (at 0.1% relative perplexity
    on this text the floor's uniform store exceeds it, the ceiling's meets it), and the loss the search
    records for them equals transformers' own loss on the same text-to-text windows with those
    experts dequantized (ppl_quantized / ppl_reference - 1)."""
    path = switch(tiny_model)
    context, limit = 64, 0.001
    # The held-out check opens the store on the float path ("auto" may pick int8 activations by timing).
    monkeypatch.setattr(pipeline, "StoreOptions", functools.partial(StoreOptions, compute="fused-float"))
    done = convert(path, tmp_path / "s", budget=QualityBudget(limit, context=context, heldout_text=PROMPT * 2),
                   calib_text=BUDGET_TEXT)
    manifest = read_manifest(tmp_path / "s")
    record = manifest.data["budget"]
    widths = {key: entry.bits for key, entry in manifest.experts.items()}
    assert widths == done.search.widths
    assert {l for l, _ in widths} == set(manifest.spec.moe_layer_ids)        # both stacks searched
    assert {record["floor"], record["ceiling"]} == set(widths.values()) and record["floor"] < record["ceiling"]
    assert record["feasible"] and record["moved_down"] == sum(b == record["floor"] for b in widths.values())
    assert record["calibration_loss_bound"] <= limit
    assert done.heldout_loss is not None and record["heldout_loss"] == done.heldout_loss
    tokenizer = edgemoe.load(path).tokenizer
    # transformers shifts the labels right from its config's start token, as edgemoe's decoder input.
    assert hf_model(path).config.decoder_start_token_id == manifest.spec.stacks.decoder_start_token_id
    calibration = tokenizer.encode(BUDGET_TEXT, add_special_tokens=False)
    assert record["calibration_loss"] == pytest.approx(hf_relative_ppl(path, widths, calibration, context),
                                                       rel=1e-3, abs=1e-6)
    # The held-out confirmation, from the written store, in the same windows of the held-out text.
    heldout = tokenizer.encode(PROMPT * 2, add_special_tokens=False)
    assert done.heldout_loss == pytest.approx(hf_relative_ppl(path, widths, heldout, context), rel=1e-3, abs=1e-6)


@torch.no_grad()
def test_a_time_target_searches_the_spread_windows_it_keeps(tiny_model, tmp_path, monkeypatch):
    """Under a time target too short for all the windows, the search's loss is transformers' own on
    the windows it kept, evenly spread (their reference computed after the choice)."""
    path = switch(tiny_model)
    context = 8
    monkeypatch.setattr(pipeline, "StoreOptions", functools.partial(StoreOptions, compute="fused-float"))
    done = convert(path, tmp_path / "s", budget=QualityBudget(0.01, context=context, search_minutes=1e-6),
                   calib_text=BUDGET_TEXT)
    assert done.sample.windows == MIN_SAMPLE_WINDOWS < done.sample.of
    widths = {key: entry.bits for key, entry in read_manifest(tmp_path / "s").experts.items()}
    calibration = edgemoe.load(path).tokenizer.encode(BUDGET_TEXT, add_special_tokens=False)
    kept = spread(MIN_SAMPLE_WINDOWS, done.sample.of)
    assert done.search.loss == pytest.approx(hf_relative_ppl(path, widths, calibration, context, kept),
                                             rel=1e-3, abs=1e-6)


def test_correlation_preloading_leaves_output_unchanged(tiny_model, tmp_path):
    path = switch(tiny_model)
    convert(path, tmp_path / "s", bits=4, calib_text=" ".join([PROMPT] * 4))
    ids = edgemoe.load(path).tokenizer.encode(PROMPT)
    opts = GenerationOptions(max_new_tokens=16)
    with edgemoe.load(tmp_path / "s", compute="fused-float", preload="none") as plain:
        expected = list(stream_tokens(plain, ids, opts))
    with edgemoe.load(tmp_path / "s", compute="fused-float", ram="20%", preload="correlation") as predicted:
        assert predicted.preloader.predictor == "correlation"
        assert list(stream_tokens(predicted, ids, opts)) == expected
        assert predicted.preloader.predicted > 0


def test_bad_input_is_named(tiny_model, store, tmp_path):
    model = edgemoe.load(switch(tiny_model))
    with pytest.raises(ValueError, match="encode: token_ids is empty"):
        model.encode([])
    with pytest.raises(ValueError, match="token id outside"):
        model.logits([1, 2], [model.spec.vocab_size])
    with pytest.raises(ValueError, match="prompt: empty"):
        list(stream_tokens(model, [], GenerationOptions()))
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["experts"][0]["tensors"]["gate"] = manifest["experts"][0]["tensors"]["up"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in store.iterdir():
        (broken / f.name).symlink_to(f)
    (broken / MANIFEST).unlink()
    (broken / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="a relu expert has"):
        edgemoe.load(broken)


@pytest.mark.parametrize("key, value, words", [
    ("router_bias", True, "router_bias"),
    ("dense_act_fn", "gelu", "dense_act_fn"),
    ("decoder_start_token_id", None, "decoder_start_token_id"),
])
def test_unsupported_configs_are_refused(tiny_model, tmp_path, key, value, words):
    source = switch(tiny_model)
    for f in source.iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    config[key] = value
    if key == "decoder_start_token_id":
        config["pad_token_id"] = None
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=words):
        edgemoe.load(tmp_path)


def test_inspect_counts_two_matrices_per_ungated_expert(tiny_model, tmp_path):
    from edgemoe.store import inspect_store

    report = convert(switch(tiny_model), tmp_path / "s", bits=8)
    assert 8 < report.bits_per_weight < 9      # the codes plus a scale and zero per row
    assert inspect_store(tmp_path / "s")["bits_per_weight"] == pytest.approx(report.bits_per_weight)


def test_small_ram_tier_and_preloading_leave_output_unchanged(tiny_model, store):
    """Experts of both stacks sharing a small RAM tier (one key space), evicted and read again: the same
    tokens as with every expert resident."""
    ids = edgemoe.load(switch(tiny_model)).tokenizer.encode(PROMPT)
    opts = GenerationOptions(max_new_tokens=16)
    with edgemoe.load(store, compute="fused-float") as roomy:
        expected = list(stream_tokens(roomy, ids, opts))
    with edgemoe.load(store, compute="fused-float", ram="20%", preload="lookahead") as tight:
        assert list(stream_tokens(tight, ids, opts)) == expected
        assert tight.store.stats.tiers["ram"].evictions > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_equals_transformers_sampling(tiny_model, seed):
    """Temperature sampling draws from the same torch generator stream as transformers' (seeded alike)."""
    path = switch(tiny_model)
    hf, model = hf_model(path), edgemoe.load(path)
    ids = model.tokenizer.encode(PROMPT)
    torch.manual_seed(seed)
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=True, temperature=0.7, top_k=0,
                           top_p=1.0)[0].tolist()
    ours = list(stream_tokens(model, ids, GenerationOptions(max_new_tokens=20, temperature=0.7, seed=seed)))
    eos = model.generation_config["eos_token_id"]
    assert ours == [t for t in expected[1:] if t != eos]


def test_store_written_before_expert_kinds_reads_as_swiglu(tiny_model, tmp_path):
    """A version-1 manifest whose spec lacks the fields added for Switch still loads, as SwiGLU."""
    from edgemoe.spec import ModelSpec

    out = tmp_path / "mixtral"
    convert(tiny_model("mixtral"), out, bits=4)
    with edgemoe.load(out, compute="fused-float") as model:
        ids = model.tokenizer.encode(PROMPT)
        expected = model.logits(ids)
    manifest = json.loads((out / MANIFEST).read_text())
    added = {"expert_activation", "stacks"}   # a decoder-only spec holds no encoder-decoder parameters
    assert added <= set(manifest["spec"]) and manifest["version"] == 1
    manifest["spec"] = {k: v for k, v in manifest["spec"].items() if k not in added}
    (out / MANIFEST).write_text(json.dumps(manifest))
    with edgemoe.load(out, compute="fused-float") as model:
        assert model.spec.expert_activation == "swiglu" and ModelSpec.from_dict(manifest["spec"]).expert_roles == (
            "gate", "up", "down")
        assert torch.equal(model.logits(ids), expected)


def test_no_preloader_predicts_from_the_encoder_into_the_decoder(store):
    with edgemoe.load(store, preload="lookahead", ram="20%") as model:
        spec = model.spec
        first_decoder_moe = min(l for l in spec.moe_layer_ids if l >= spec.stacks.encoder_layers)
        last_encoder_moe = max(l for l in spec.moe_layer_ids if l < spec.stacks.encoder_layers)
        assert first_decoder_moe not in model.preloader.next_moe.values()
        assert last_encoder_moe not in model.preloader.next_moe        # its next MoE layer is the decoder's
        assert model.preloader.next_moe                                # within each stack it predicts
