"""Every command's options with bad values: exit status 2 and one line on stderr naming the flag, and
nothing written or replaced. Checked where the value enters, before any model is loaded where the
value alone is wrong; after loading where it depends on the model (a window past its context)."""

import json
import os
import sys

import pytest

from edgemoe.convert import convert
from helpers import run_cli


@pytest.fixture(scope="module")
def paths(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    checkpoint = tiny_model("mixtral", max_position_embeddings=64)
    store = root / "store"
    convert(checkpoint, store, bits=4)
    text = root / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    binary = root / "trace.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    trace = root / "trace.jsonl"
    trace.write_text("".join(json.dumps({"seq": 0, "token": t, "layer": 0, "experts": [t % 4, (t + 1) % 4],
                                         "weights": [0.6, 0.4]}) + "\n" for t in range(8)))
    return {"CKPT": str(checkpoint), "STORE": str(store), "TEXT": str(text), "BIN": str(binary),
            "OUT": str(root / "new-store"), "TRACE": str(trace), "NOWHERE": str(root / "nowhere.txt")}


BAD = [
    # run
    (["run", "CKPT", "--temperature", "nan"], "--temperature"),
    (["run", "CKPT", "--temperature", "-1"], "--temperature"),
    (["run", "CKPT", "--temperature", "abc"], "--temperature"),
    (["run", "CKPT", "--top-p", "0"], "--top-p"),
    (["run", "CKPT", "--top-p", "1.5"], "--top-p"),
    (["run", "CKPT", "--top-k", "-1"], "--top-k"),
    (["run", "CKPT", "-n", "-3"], "--max-new-tokens"),
    (["run", "STORE", "--ram", "inf"], "--ram"),
    (["run", "STORE", "--ram", "-5"], "--ram"),
    (["run", "STORE", "--ram", "lots"], "--ram"),
    (["run", "STORE", "--ram", "150%"], "--ram"),
    (["run", "STORE", "--vram", "nan"], "--vram"),
    (["run", "STORE", "--vram", "1MiB", "--device", "nonsense"], "--device"),
    (["run", "STORE", "--policy", "bogus"], "--policy"),
    (["run", "STORE", "--preload", "bogus"], "--preload"),
    (["run", "STORE", "--skip-below", "1.5"], "--skip-below"),
    (["run", "CKPT", "--skip-below", "0.2"], "--skip-below"),          # a checkpoint reads no experts
    (["run", "CKPT", "--ram", "25%"], "--ram"),           # a checkpoint has no store to budget
    (["run", "CKPT", "--dtype", "int3"], "--dtype"),
    (["run", "CKPT", "--threads", "0"], "--threads"),
    (["run", "STORE", "--replay", "BIN"], "trace.bin"),
    (["run", "CKPT", "--bogus"], "--bogus"),
    (["run", "CKPT", "--beams", "0"], "--beams"),
    (["run", "CKPT", "--beams", "two"], "--beams"),
    (["run", "CKPT", "--beams", "2", "--temperature", "0.7"], "--temperature"),   # beams do not sample
    (["run", "CKPT", "--beams", "2", "--top-k", "5"], "--top-k"),
    (["run", "CKPT", "--beams", "2", "--top-p", "0.9"], "--top-p"),
    (["run", "CKPT", "--beams", "2", "--seed", "1"], "--seed"),
    (["run", "CKPT", "--beams", "2", "--stop", "x"], "--stop"),
    (["run", "CKPT", "--beams", "2", "--length-penalty", "nan"], "--length-penalty"),
    (["run", "CKPT", "--length-penalty", "0.5"], "--length-penalty"),            # only with --beams
    (["run", "CKPT", "--early-stopping"], "--early-stopping"),
    # convert
    (["convert", "CKPT", "-o", "OUT", "--bits", "3"], "--bits"),
    (["convert", "CKPT", "-o", "OUT", "--fallback-bits", "8"], "--fallback-bits"),
    (["convert", "CKPT", "-o", "OUT", "--budget", "200%"], "--budget"),
    (["convert", "CKPT", "-o", "OUT", "--budget", "nan"], "--budget"),
    (["convert", "CKPT", "-o", "OUT", "--budget", "-1%"], "--budget"),
    (["convert", "CKPT", "-o", "OUT", "--metric", "bleu"], "--metric"),
    (["convert", "CKPT", "-o", "OUT", "--method", "gptq"], "--method"),
    (["convert", "CKPT", "-o", "OUT", "--compress", "gzip"], "--compress"),
    (["convert", "CKPT", "-o", "OUT", "--group-size", "0"], "--group-size"),
    (["convert", "CKPT", "-o", "OUT", "--workers", "0"], "--workers"),
    (["convert", "CKPT", "-o", "OUT", "--confidence", "1.5"], "--confidence"),
    (["convert", "CKPT", "-o", "OUT", "--calib-tokens", "1"], "--calib-tokens"),
    (["convert", "CKPT", "-o", "CKPT", "--force"], "is the input"),
    (["convert", "CKPT", "-o", "OUT", "--calib", "NOWHERE"], "nowhere.txt"),   # read before any work
    # eval
    (["eval", "CKPT", "--text", "TEXT", "--context", "0"], "--context"),
    (["eval", "CKPT", "--text", "TEXT", "--context", "600"], "--context"),   # past the model's 64
    (["eval", "CKPT", "--text", "TEXT", "--stride", "0"], "--stride"),
    (["eval", "CKPT", "--text", "TEXT", "--context", "32", "--stride", "40"], "--stride"),
    (["eval", "CKPT", "--text", "TEXT", "--ram", "1GiB"], "--ram"),
    (["eval", "STORE", "--text", "TEXT", "--ram", "lots"], "--ram"),
    (["eval", "STORE", "--text", "TEXT", "--fallback-below", "1"], "--fallback-below"),
    (["run", "STORE", "--fallback-below", "0.3"], "--fallback-below"),     # the store has no copies
    # trace, profile, inspect
    (["trace", "CKPT", "--text", "TEXT", "-o", "OUT", "--context", "1"], "--context"),
    (["trace", "CKPT", "--text", "TEXT", "-o", "OUT", "--context", "65"], "--context"),
    (["profile", "STORE", "--text", "TEXT", "--min-count", "0"], "--min-count"),
    (["profile", "STORE", "--text", "TEXT", "--context", "100"], "--context"),
    (["profile", "CKPT", "--text", "TEXT"], "not a store"),
    (["profile", "STORE", "--trace", "BIN"], "trace.bin"),
    (["inspect", "STORE", "--ram", "lots"], "--ram"),
    # serve, chat
    (["serve", "CKPT", "--port", "70000"], "--port"),
    (["serve", "CKPT", "--max-batch", "0"], "--max-batch"),
    (["serve", "CKPT", "--max-connections", "0"], "--max-connections"),
    (["serve", "CKPT", "--request-timeout", "0"], "--request-timeout"),
    (["serve", "CKPT", "--keep-alive-timeout", "nan"], "--keep-alive-timeout"),
    (["serve", "CKPT", "--ram", "1GiB"], "--ram"),
    (["chat", "CKPT", "--temperature", "nan"], "--temperature"),
    (["chat", "CKPT", "-n", "0"], "--max-new-tokens"),
    # bench
    (["bench", "STORE", "--ram", "abc"], "--ram"),
    (["bench", "STORE", "--mode", "fast"], "--mode"),
    (["bench", "STORE", "--prefill", "0"], "--prefill"),
    (["bench", "STORE", "--prefill", "60"], "--prefill"),   # 60 + 36 decode steps > 64
    (["bench", "STORE", "--repeats", "0"], "--repeats"),
    (["bench", "STORE", "--decode-tokens", "0"], "--decode-tokens"),
    (["bench", "STORE", "--warmup-tokens", "-1"], "--warmup-tokens"),
    (["bench", "STORE", "--memory-limit", "lots"], "--memory-limit"),
    (["bench", "STORE", "--compute", "gpu"], "--compute"),
    (["bench", "STORE", "--skip-below", "1"], "--skip-below"),
    (["bench", "STORE", "--fallback-below", "-0.1"], "--fallback-below"),
    (["eval", "STORE", "--text", "TEXT", "--compute", "fused"], "--compute"),
    # simulate
    (["simulate", "TRACE", "--cache-experts", "0"], "--cache-experts"),
    (["simulate", "TRACE", "--cache-experts", "4", "--policy", "fifo"], "--policy"),
    (["simulate", "TRACE", "--cache-experts", "4", "--min-probability", "2"], "--min-probability"),
    (["simulate", "TRACE", "--cache-experts", "4", "--tokens", "0"], "--tokens"),
    (["simulate", "BIN", "--cache-experts", "4"], "trace.bin"),
]


@pytest.mark.parametrize("args, flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_exit_2_with_one_line_naming_the_flag(monkeypatch, capsys, paths, args, flag):
    code, err = run_cli(monkeypatch, capsys, *[paths.get(a, a) for a in args])
    assert code == 2, err
    assert err.count("\n") == 0 and err.startswith("error: ") and flag in err, err
    assert "----" not in err and "Traceback" not in err
    assert not os.path.exists(paths["OUT"])


def test_a_config_that_is_not_an_object_or_has_a_fractional_count_is_named(monkeypatch, capsys, tiny_model,
                                                                            tmp_path):
    import shutil
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_model("mixtral"), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    for bad, message in (([config], "expected a JSON object"), ({**config, "num_local_experts": 8.5},
                                                                 "num_local_experts=8.5: expected an integer")):
        (checkpoint / "config.json").write_text(json.dumps(bad))
        code, err = run_cli(monkeypatch, capsys, "run", str(checkpoint), "-p", "x")
        assert code == 2 and err.count("\n") == 0 and "config.json" in err and message in err, err


def test_no_progress_output_off_a_terminal_and_convert_reports_its_whole_time(paths, tmp_path):
    import subprocess
    out = subprocess.run([sys.executable, "-m", "edgemoe", "eval", paths["CKPT"], "--text", paths["TEXT"]],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == "" and "perplexity:" in out.stdout
    made = subprocess.run([sys.executable, "-m", "edgemoe", "convert", paths["CKPT"], "-o", str(tmp_path / "s"),
                           "--calib", paths["TEXT"]], capture_output=True, text=True)
    assert made.returncode == 0 and made.stderr == "" and " s in all" in made.stdout
