"""Bad checkpoints and options: one clear error line naming the file or tensor, and a non-zero exit."""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

import edgemoe
from edgemoe.cli import main
from edgemoe.errors import CheckpointError, UnsupportedModelError
from helpers import run_cli


@pytest.fixture
def checkpoint(tiny_model, tmp_path):
    """A private copy of a tiny checkpoint that a test may damage."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model("mixtral"), path)
    return path


def test_missing_directory(monkeypatch, capsys, tmp_path):
    code, err = run_cli(monkeypatch, capsys, "run", str(tmp_path / "nowhere"), "-p", "x")
    assert code == 2 and err.count("\n") == 0
    assert "nowhere" in err and "no such checkpoint directory" in err


def test_unsupported_model_type(monkeypatch, capsys, checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    code, err = run_cli(monkeypatch, capsys, "run", str(checkpoint), "-p", "x")
    assert code == 2 and err.count("\n") == 0
    assert "'gpt2'" in err and "config.json" in err and "mixtral" in err
    with pytest.raises(UnsupportedModelError):
        edgemoe.load(checkpoint)


def test_truncated_safetensors(monkeypatch, capsys, checkpoint):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    code, err = run_cli(monkeypatch, capsys, "run", str(checkpoint), "-p", "x")
    assert code == 2 and err.count("\n") == 0
    assert "model.safetensors" in err and "truncated" in err


def test_shape_mismatch_names_the_tensor_and_both_shapes(monkeypatch, capsys, checkpoint):
    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, weights)
    code, err = run_cli(monkeypatch, capsys, "run", str(checkpoint), "-p", "x")
    assert code == 2 and err.count("\n") == 0
    assert name in err and "(95, 64)" in err and "(96, 64)" in err


def test_missing_and_unused_tensors_are_all_named(checkpoint):
    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.q_norm.weight"] = tensors.pop("model.layers.0.input_layernorm.weight")
    save_file(tensors, weights)
    with pytest.raises(CheckpointError) as info:
        edgemoe.load(checkpoint)
    message = str(info.value)
    assert "missing tensor model.layers.0.input_layernorm.weight" in message
    assert "unused tensors model.layers.0.self_attn.q_norm.weight" in message


def test_missing_config_value_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["num_local_experts"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json.*num_local_experts"):
        edgemoe.load(checkpoint)


def test_console_script_streams_text_and_fails_cleanly(tiny_model, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "edgemoe", "run", str(tiny_model("mixtral")), "-p", "To be",
                         "-n", "8"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("To be") and len(ok.stdout) > len("To be\n")
    bad = subprocess.run([sys.executable, "-m", "edgemoe", "run", str(tmp_path / "none")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr


def test_dtype_option(monkeypatch, capsys, tiny_model):
    path = tiny_model("mixtral", dtype="bfloat16")
    code, err = run_cli(monkeypatch, capsys, "eval", str(path), "--text", str(path / "config.json"), "--dtype", "int3")
    assert code == 2 and "--dtype" in err and "'int3'" in err
    results = {}
    for dtype in ("bfloat16", "float32"):
        monkeypatch.setattr(sys, "argv", ["edgemoe", "eval", str(path), "--text", str(path / "config.json"),
                                          "--dtype", dtype, "--json"])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 0
        results[dtype] = json.loads(capsys.readouterr().out)["perplexity"]
    # bfloat16 matrices and float32 ones compute different logits on a bfloat16 checkpoint
    assert results["bfloat16"] != results["float32"] and abs(results["bfloat16"] / results["float32"] - 1) < 0.01
