"""Dense projections quantized at load (edgemoe.dense, --dense-bits), against plain torch computations."""

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F

import edgemoe
from edgemoe.bench import Bandwidths
from edgemoe.cli import main
from edgemoe.dense import KERNEL_MAX_TOKENS, QUANTIZED_ROLES, QuantizedLinear, dense_bits_for, quantize_matrix
from edgemoe.model import MoEModel, Segment
from edgemoe.options import OptionError
from edgemoe.quant import dequantize_reference

from helpers import run_cli, weights


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("past_limit", [-1, 0, 1, 30])   # tokens relative to the width's kernel limit
def test_quantized_linear_is_the_dequantized_matrix_product(bits, past_limit):
    tokens = max(1, KERNEL_MAX_TOKENS[bits] + past_limit)
    w = weights(96, 200, seed=bits)
    layer = quantize_matrix(w, bits)
    x = torch.randn(tokens, 200, generator=torch.Generator().manual_seed(tokens))
    expected = F.linear(x.double(), dequantize_reference(layer.qt).double()).float()
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (tokens, 96)
    # Few tokens multiply on the integer kernel (activations rounded to int8: ~1% of a row's scale),
    # more by dequantize + GEMM (float32 rounding only).
    tolerance = 2e-2 if tokens <= KERNEL_MAX_TOKENS[bits] else 1e-4
    assert torch.allclose(y, expected, rtol=0, atol=tolerance * expected.abs().max().item())
    # the quantized matrix itself is close to the original: the width was applied, not ignored
    err = (dequantize_reference(layer.qt) - w).abs().max().item()
    assert 0 < err < {8: 0.01, 4: 0.2}[bits] * w.abs().max().item()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matrix_quantized_in_row_blocks_has_the_codes_of_one_piece(bits, dtype, monkeypatch):
    """quantize_matrix quantizes QUANTIZE_BLOCK_BYTES of rows at a time (its float temporaries stay
    small): rows are quantized on their own, so the blocks stacked are the whole matrix quantized."""
    import edgemoe.dense
    from edgemoe.quant import quantize
    w = torch.randn(37, 256).to(dtype)
    monkeypatch.setattr(edgemoe.dense, "QUANTIZE_BLOCK_BYTES", 5 * 4 * 256)     # 5 rows: 8 blocks, the last of 2
    blocked = quantize_matrix(w, bits).qt
    whole = quantize(w, bits, edgemoe.dense.GROUP_SIZE[bits])
    assert blocked.shape == whole.shape and blocked.group == whole.group
    for name in ("packed", "scale", "zero"):
        assert (getattr(blocked, name) == getattr(whole, name)).all(), name


def test_a_model_quantizes_its_projections_and_lm_head_only(tiny_model):
    float_model = edgemoe.load(tiny_model("mixtral"), torch.bfloat16)
    model = edgemoe.load(tiny_model("mixtral"), torch.bfloat16, dense_bits=8)
    for w, w_float in zip(model.layers, float_model.layers):
        stacked = torch.cat([w_float[role] for role in ("q", "k", "v")])   # q, k, v as one matrix
        assert isinstance(w["qkv"], QuantizedLinear) and w["qkv"].shape == tuple(stacked.shape)
        assert torch.equal(dequantize_reference(w["qkv"].qt), dequantize_reference(quantize_matrix(stacked, 8).qt))
        for name, t in w.items():
            if name in QUANTIZED_ROLES:
                assert isinstance(t, QuantizedLinear) and t.shape == tuple(w_float[name].shape)
            elif name == "router":
                assert t.dtype == torch.float32 and torch.equal(t, w_float[name].float())
            elif name != "qkv":
                assert torch.equal(t, w_float[name])   # norms: as loaded
    assert isinstance(model.lm_head, QuantizedLinear)
    assert torch.equal(model.embed, float_model.embed)


def test_a_tied_lm_head_is_a_quantized_copy_of_the_embedding(tiny_model):
    path = tiny_model("qwen2_moe", tie_word_embeddings=True)
    model = edgemoe.load(path, dense_bits=8)
    assert model.spec.tie_word_embeddings and isinstance(model.embed, torch.Tensor)
    expected = quantize_matrix(model.embed, 8).qt
    assert (model.lm_head.qt.packed == expected.packed).all()


def dequantized_twin(model: MoEModel) -> MoEModel:
    """The same model with every QuantizedLinear replaced by its dequantized float32 matrix."""
    dense = {name: dequantize_reference(w.qt) if isinstance(w, QuantizedLinear) else w
             for name, w in model.dense_weights().items()}
    dense["lm_head"] = dequantize_reference(model.lm_head.qt)
    spec = dataclasses.replace(model.spec, tie_word_embeddings=False)
    return MoEModel(spec, dense, model.experts)


@pytest.mark.parametrize("bits", [8, 4])
def test_logits_are_those_of_the_dequantized_weights_in_prefill_and_cached_decode(tiny_model, bits):
    model = edgemoe.load(tiny_model("mixtral", tie_word_embeddings=True), dense_bits=bits)
    twin = dequantized_twin(model)
    tokens = torch.arange(3, 3 + 20)
    expected = twin.logits(tokens)
    scale = expected.abs().max().item()
    prefill = model.logits(tokens)                  # dequantize + GEMM
    assert (prefill - expected).abs().max().item() < 1e-4 * scale
    cache = model.new_cache()
    model.logits(tokens[:4], cache)
    decoded = torch.cat([model.logits(tokens[i:i + 1], cache) for i in range(4, len(tokens))])   # the kernel
    # int8 activations round each product by up to ~0.5%, compounded over the layers of a random
    # model whose logits are near-ties (so argmax is no measure here: see the trained model below);
    # a wrong kernel is off by the whole scale
    assert (decoded - expected[4:]).abs().mean().item() < 0.02 * scale


def test_a_trained_model_keeps_its_predictions_at_8_bits():
    """The bundled model (trained): int8 dense projections agree with float32 on the next token
    nearly always (the full eval is in docs/benchmarks.md)."""
    from edgemoe.bundled import bundled_model_path
    from edgemoe.evaluate import evaluate_text
    path = bundled_model_path()
    text = (path / "eval.txt").read_text()[:3000]
    result = evaluate_text(edgemoe.load(path, dense_bits=8), text, reference=edgemoe.load(path), decode=True)
    assert result.top1_agreement >= 0.97
    assert abs(result.perplexity / result.reference_perplexity - 1) < 0.01


def test_dense_bits_reach_a_store_model_and_the_forward_step(tiny_model, tmp_path):
    from edgemoe.convert import convert
    store = tmp_path / "store"
    convert(tiny_model("mixtral"), store, bits=8)
    with edgemoe.load(store, dense_bits=8) as model:
        assert isinstance(model.layers[0]["qkv"], QuantizedLinear)
        cache = model.new_cache()
        logits = model.forward(torch.tensor([5, 6, 7]), [Segment(cache, 3)], last_only=True)
        assert logits.shape == (1, model.spec.vocab_size) and torch.isfinite(logits).all()


def test_auto_quantizes_a_stores_dense_matrices_by_its_expert_widths_and_keeps_a_checkpoints(
        tiny_model, tmp_path, monkeypatch, capsys):
    from edgemoe.convert import convert
    checkpoint = tiny_model("mixtral")
    for bits in (4, 8):
        convert(checkpoint, tmp_path / f"int{bits}", bits=bits)
        with edgemoe.load(tmp_path / f"int{bits}", dense_bits="auto") as model:
            assert model.dense_bits == bits and isinstance(model.layers[0]["qkv"], QuantizedLinear)
            assert model.layers[0]["qkv"].qt.bits == bits
    for path, choice in ((checkpoint, "auto"), (tmp_path / "int4", "none"), (tmp_path / "int4", None)):
        with edgemoe.load(path, dense_bits=choice) as model:
            assert model.dense_bits is None and isinstance(model.layers[0]["q"], torch.Tensor)
    seen = []
    monkeypatch.setattr(MoEModel, "quantize_dense", lambda self, bits: seen.append(bits))
    for store, flags, expected in (("int4", [], [4]), ("int8", [], [8]), ("int4", ["--dense-bits", "none"], []),
                                   ("int8", ["--dense-bits", "4"], [4])):
        seen.clear()
        status, err = run_cli(monkeypatch, capsys, "run", str(tmp_path / store), "-p", "a", "-n", "1", *flags)
        assert status == 0 and seen == expected, (flags, err)


def test_auto_keeps_8_bits_where_one_expert_is_wider_or_a_budget_chose_the_widths(tiny_model, tmp_path):
    from edgemoe.convert import convert
    from edgemoe.store import read_manifest
    convert(tiny_model("mixtral"), tmp_path / "store", bits=4)
    manifest = read_manifest(tmp_path / "store")
    assert dense_bits_for("auto", manifest, manifest.spec) == 4
    assert dense_bits_for("auto", None, manifest.spec) is None          # a checkpoint directory
    key = next(iter(manifest.experts))
    wider = dataclasses.replace(manifest, experts={**manifest.experts,
                                                   key: dataclasses.replace(manifest.experts[key], bits=8)})
    assert dense_bits_for("auto", wider, manifest.spec) == 8
    budgeted = dataclasses.replace(manifest, data={**manifest.data, "budget": {}})
    assert dense_bits_for("auto", budgeted, manifest.spec) == 8
    assert dense_bits_for("none", manifest, manifest.spec) is None and dense_bits_for(8, manifest, manifest.spec) == 8


def test_bad_dense_bits_are_refused_by_name(tiny_model, monkeypatch, capsys):
    with pytest.raises(OptionError, match="dense_bits="):
        edgemoe.load(tiny_model("mixtral"), dense_bits=2)
    status, err = run_cli(monkeypatch, capsys, "run", str(tiny_model("mixtral")), "-p", "a", "--dense-bits", "3")
    assert status == 2 and "--dense-bits" in err


def test_eval_applies_dense_bits(tiny_model, tmp_path, monkeypatch, capsys):
    """Against the same checkpoint in float, an eval with --dense-bits 4 disagrees a little: it was applied."""
    import json
    path = tiny_model("mixtral")
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question " * 4)
    monkeypatch.setattr(sys, "argv", ["edgemoe", "eval", str(path), "--text", str(text), "--reference", str(path),
                                      "--dense-bits", "4", "--json"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kl"] > 0 and result["perplexity"] != result["reference_perplexity"]


@pytest.mark.parametrize("command", [["run", "-p", "a", "-n", "2"], ["bench", "--prefill", "4", "--decode-tokens", "1",
                                                                     "--repeats", "1", "--mode", "all-in-ram"]])
def test_commands_quantize_the_dense_matrices_when_asked(tiny_model, tmp_path, monkeypatch, capsys, command):
    from edgemoe.convert import convert
    store = tmp_path / "store"
    convert(tiny_model("mixtral"), store, bits=4)
    widths = []
    original = MoEModel.quantize_dense
    monkeypatch.setattr(MoEModel, "quantize_dense", lambda self, bits: (widths.append(bits), original(self, bits)))
    monkeypatch.setattr("edgemoe.bench.measure_bandwidths", lambda path: Bandwidths(memory=10e9, disk=1e9))
    status, err = run_cli(monkeypatch, capsys, command[0], str(store), *command[1:], "--dense-bits", "8")
    assert status == 0, err
    assert widths and set(widths) == {8}


def test_a_long_step_multiplies_in_the_dtype_of_the_matrix_it_replaced(tiny_model):
    """Past KERNEL_MAX_TOKENS a QuantizedLinear dequantizes and runs one GEMM: in bfloat16 for a model
    loaded in bfloat16 (the type the CPU was chosen to multiply in), float32 otherwise; plain torch
    on the dequantized weight is the reference, bit for bit."""
    for dtype in (torch.bfloat16, torch.float32):
        matrix = edgemoe.load(tiny_model("mixtral"), dtype, dense_bits=8).layers[0]["o"]
        assert matrix.gemm_dtype == dtype
        x = torch.randn(KERNEL_MAX_TOKENS[8] + 5, matrix.shape[1])
        expected = F.linear(x.to(dtype), dequantize_reference(matrix.qt).to(dtype)).float()
        assert torch.equal(matrix(x), expected)
