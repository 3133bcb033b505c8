"""The bundled checkpoint is a real Mixtral checkpoint of the promised shape and size."""

import json
from pathlib import Path

import pytest

BUNDLE = Path(__file__).resolve().parents[1] / "edgemoe/bundled/shakespeare-moe"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "eval.txt", "calib.txt", "CREDITS.md", "training.json")


def test_files_present_and_small():
    for name in FILES:
        assert (BUNDLE / name).is_file(), name
    assert (BUNDLE / "model.safetensors").stat().st_size <= 25_000_000


def test_config_shape():
    cfg = json.loads((BUNDLE / "config.json").read_text())
    assert cfg["model_type"] == "mixtral"
    assert cfg["num_hidden_layers"] >= 6
    assert cfg["num_local_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA


def test_weights_are_bf16_with_per_expert_names():
    from safetensors import safe_open

    with safe_open(str(BUNDLE / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in keys


def test_transformers_loads_and_runs():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.MixtralForCausalLM.from_pretrained(BUNDLE, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(BUNDLE)
    ids = tok("Friends, Romans, countrymen, lend me your ears;", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    out = model(ids, labels=ids)
    assert torch.isfinite(out.loss) and out.loss.item() < 8.0


def test_tokenizer_round_trips():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(BUNDLE / "tokenizer.json"))
    line = "O Romeo, Romeo! wherefore art thou Romeo?  — naïve 123\n"
    assert tok.decode(tok.encode(line).ids) == line


def test_eval_and_calib_are_disjoint():
    def long_lines(name):
        return {ln for ln in (BUNDLE / name).read_text(encoding="utf-8").splitlines() if len(ln) >= 30}

    assert long_lines("eval.txt").isdisjoint(long_lines("calib.txt"))
