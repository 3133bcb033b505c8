"""Non-finite weights: a NaN or an infinity in an expert or a dense tensor is refused where it is
loaded (convert, run, eval), in one line naming the tensor and its file; a store's dense weights
likewise; and eval never prints a nan perplexity with exit status 0."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import edgemoe
from edgemoe.evaluate import evaluate
from edgemoe.errors import CheckpointError, EdgeMoEError
from edgemoe.store.format import StoreError, file_crc32
from helpers import run_cli

EXPERT = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
DENSE = "model.layers.0.self_attn.k_proj.weight"


def damaged(tiny_model, tmp_path, name, index, value, arch="mixtral", **model_options):
    """A copy of a tiny checkpoint with tensor `name`[index] replaced by `value`."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model(arch, **model_options), path)
    tensors = load_file(path / "model.safetensors")
    tensors[name][index] = value
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", [EXPERT, DENSE])
def test_run_eval_and_convert_refuse_the_tensor_by_name_and_file(monkeypatch, capsys, tiny_model, tmp_path, name,
                                                                 value):
    path = damaged(tiny_model, tmp_path, name, (3, 5), value)
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question. " * 4)
    expected = f"error: {path / 'model.safetensors'}: tensor {name!r}: 1 non-finite value (nan or inf) of "
    for command in (["run", str(path), "-p", "To be", "-n", "4"], ["eval", str(path), "--text", str(text)],
                    ["convert", str(path), "-o", str(tmp_path / "store"), "--bits", "4", "--quiet"]):
        code, err = run_cli(monkeypatch, capsys, *command)
        assert code == 2 and err.startswith(expected) and "\n" not in err, (command, err)
    assert not (tmp_path / "store").exists()


def test_a_fused_expert_is_named_with_its_index(tiny_model, tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.gate_up_proj"
    path = damaged(tiny_model, tmp_path, name, (3, slice(5, 7), 7), float("nan"), fused_experts=True)   # expert 3
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{name}' \[3\]: 2 non-finite values"):
        edgemoe.load(path)


def test_an_mxfp4_scale_that_decodes_to_infinity_is_refused(tiny_model, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj"
    path = damaged(tiny_model, tmp_path, name + "_scales", (2, 0, 0), 255, arch="gpt_oss", mxfp4=True)   # 2^128
    with pytest.raises(CheckpointError, match=rf"tensor '{name}_blocks' \[2\], decoded: 32 non-finite values"):
        edgemoe.load(path)


def _store_with_damaged_dense(monkeypatch, capsys, tiny_model, tmp_path, damage):
    """A converted store whose dense tensors `damage(tensors)` changed, its checksum updated as a store
    written so would have it (the checksum matches, the weights do not): (store, dense file, tensors)."""
    store = tmp_path / "store"
    code, err = run_cli(monkeypatch, capsys, "convert", str(tiny_model("mixtral")), "-o", str(store), "--bits", "4",
                        "--quiet")
    assert code == 0, err
    dense = store / "dense.safetensors"
    tensors = load_file(dense)
    damage(tensors)
    save_file(tensors, dense)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["dense"]["crc32"] = file_crc32(dense)
    (store / "manifest.json").write_text(json.dumps(manifest))
    return store, dense, tensors


def test_a_store_with_a_non_finite_dense_weight_is_refused_by_name(monkeypatch, capsys, tiny_model, tmp_path):
    names = []

    def damage(tensors):
        names.append(next(n for n in sorted(tensors) if tensors[n].dim() == 2))
        tensors[names[0]][0, 0] = float("-inf")

    store, dense, _ = _store_with_damaged_dense(monkeypatch, capsys, tiny_model, tmp_path, damage)
    with pytest.raises(StoreError, match=rf"^{dense}: tensor '{names[0]}': 1 non-finite value"):
        edgemoe.load(store)


def test_a_non_finite_value_in_a_matrix_quantized_at_load_is_refused_with_the_whole_matrixs_count(
        monkeypatch, capsys, tiny_model, tmp_path):
    """--dense-bits reads a matrix a block of rows at a time: bad values in two blocks are counted
    together, as a matrix read whole is."""
    from edgemoe import dense as dense_module

    def damage(tensors):
        tensors["lm_head"][0, 0] = float("nan")
        tensors["lm_head"][-1, -1] = float("inf")

    store, dense, tensors = _store_with_damaged_dense(monkeypatch, capsys, tiny_model, tmp_path, damage)
    monkeypatch.setattr(dense_module, "QUANTIZE_BLOCK_BYTES", 4 * tensors["lm_head"].shape[1] * 4)   # 4 rows
    total = tensors["lm_head"].numel()
    with pytest.raises(StoreError, match=rf"^{dense}: tensor 'lm_head': 2 non-finite values \(nan or inf\) of {total}"):
        edgemoe.load(store, dense_bits=4)


def test_eval_refuses_a_loss_that_overflows(monkeypatch, capsys, tiny_model, tmp_path):
    """Finite weights can still overflow float32: eval fails naming the tokens, instead of 'perplexity: nan'."""
    path = damaged(tiny_model, tmp_path, "lm_head.weight", slice(None), 3e38)   # the logits overflow float32
    model = edgemoe.load(path, torch.float32)
    with pytest.raises(EdgeMoEError, match=r"^evaluate: the loss of tokens 1\.\.7 is nan"):
        evaluate(model, list(range(3, 11)), context=8)
    with pytest.raises(EdgeMoEError, match=r"^evaluate: the reference's loss of tokens 1\.\.7 is nan"):
        evaluate(edgemoe.load(tiny_model("mixtral")), list(range(3, 11)), context=8, reference=model)
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be. " * 4)
    code, err = run_cli(monkeypatch, capsys, "eval", str(path), "--text", str(text))
    assert code == 2 and err.startswith("error: evaluate: the loss of tokens") and "\n" not in err


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_run_refuses_logits_that_overflow(monkeypatch, capsys, tiny_model, tmp_path, temperature):
    """Not a torch RuntimeError from the sampler, nor (greedy) a token picked from nans."""
    path = damaged(tiny_model, tmp_path, "lm_head.weight", slice(None), 3e38)
    code, err = run_cli(monkeypatch, capsys, "run", str(path), "-p", "To be", "-n", "3", "--temperature", temperature)
    assert code == 2 and err == ("error: generate: the model computed non-finite logits (nan or inf): "
                                 "an overflow in its dtype?")
