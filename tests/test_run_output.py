"""What `edgemoe run` prints: a prompt past the context is refused before anything is echoed, a
truncated one is echoed as the tokens the model saw; --stats counts a prompt fed in several chunks as
one prefill (time to first token) and decodes only the generated tokens. And `edgemoe convert` says,
before any work, that a checkpoint without tokenizer.json would make a store run cannot use."""

import re
import shutil
import sys

import pytest

import edgemoe
from edgemoe.cli import main
from edgemoe.stats import run_stats

BEGINNING = "Once upon a midnight dreary, "
FILLER = "while I pondered, weak and weary, over many a quaint and curious volume of forgotten lore. "


def run(monkeypatch, capsys, *args):
    """(exit status, stdout, stderr) of `edgemoe ARGS`."""
    monkeypatch.setattr(sys, "argv", ["edgemoe", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.fixture(scope="module")
def short_context(tiny_model):
    return tiny_model("mixtral", max_position_embeddings=64)


@pytest.fixture(scope="module")
def long_context(tiny_model):
    return tiny_model("mixtral", max_position_embeddings=1024)


def test_a_prompt_past_the_context_is_refused_before_anything_is_echoed(monkeypatch, capsys, short_context):
    prompt = BEGINNING + FILLER * 40
    code, out, err = run(monkeypatch, capsys, "run", str(short_context), "-p", prompt, "-n", "4")
    assert code == 2 and "context is 64" in err and err.count("\n") == 1, err
    assert out == ""


@pytest.mark.parametrize("beams", [False, True])
def test_a_truncated_prompt_is_echoed_as_the_tokens_the_model_saw(monkeypatch, capsys, short_context, beams):
    prompt = BEGINNING + FILLER * 40
    tokenizer = edgemoe.load(short_context).tokenizer
    ids = tokenizer.encode(prompt)
    code, out, err = run(monkeypatch, capsys, "run", str(short_context), "-p", prompt, "-n", "4", "--truncate",
                         *(["--beams", "2"] if beams else ["--temperature", "0"]))
    assert code == 0 and "truncated from the left to its last 60 of" in err, err
    assert out.startswith(tokenizer.decode(ids[-60:]))
    assert BEGINNING not in out and len(out) < len(prompt) // 4


def test_a_prompt_that_fits_is_echoed_as_given(monkeypatch, capsys, short_context):
    code, out, err = run(monkeypatch, capsys, "run", str(short_context), "-p", BEGINNING, "-n", "2",
                         "--temperature", "0")
    assert code == 0 and out.startswith(BEGINNING), err


def test_stats_count_every_prefill_chunk_as_prefill_and_only_generated_tokens_as_decode(long_context):
    model = edgemoe.load(long_context)
    prompt = list(range(3, 23))                       # 20 tokens: chunks of 8, 8 and 4
    model.generate(prompt, max_new_tokens=5, temperature=0, prefill_chunk=8, stop_token_ids=[])
    stats = run_stats(model)
    assert [n for n, _ in model.timings.per_step] == [8, 8, 4, 1, 1, 1, 1]
    assert stats["prefill_tokens"] == 20
    assert stats["ttft_s"] == pytest.approx(sum(s for _, s in model.timings.per_step[:3]))
    assert stats["decode_tokens"] == 4                # 5 generated, the first by the prefill


def test_stats_of_a_stop_token_first_are_all_prefill(long_context):
    model = edgemoe.load(long_context)
    first = model.logits(list(range(3, 23)))[-1].argmax().item()
    model.timings.reset()
    model.generate(list(range(3, 23)), max_new_tokens=5, temperature=0, prefill_chunk=8, stop_token_ids=[first])
    stats = run_stats(model)
    assert stats["prefill_tokens"] == 20 and stats["decode_tokens"] == 0


def test_run_stats_with_a_prompt_longer_than_the_prefill_chunk(monkeypatch, capsys, long_context):
    prompt = BEGINNING + FILLER * 12
    prompt_tokens = len(edgemoe.load(long_context).tokenizer.encode(prompt))
    assert prompt_tokens > 512                         # GenerationOptions.prefill_chunk: two chunks
    code, out, err = run(monkeypatch, capsys, "run", str(long_context), "-p", prompt, "-n", "4", "--stats",
                         "--temperature", "0")
    assert code == 0, err
    line = re.search(r"\[stats\] prefill (\d+) tokens.*decode (\d+) tokens", err)
    assert line and int(line[1]) == prompt_tokens and int(line[2]) <= 3, err


@pytest.fixture
def without_tokenizer(short_context, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(short_context, checkpoint)
    (checkpoint / "tokenizer.json").unlink()
    return checkpoint


def test_convert_refuses_a_checkpoint_without_tokenizer_json_unless_allowed(monkeypatch, capsys, without_tokenizer,
                                                                            tmp_path):
    out = tmp_path / "store"
    code, out_text, err = run(monkeypatch, capsys, "convert", str(without_tokenizer), "-o", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert str(without_tokenizer / "tokenizer.json") in err and "--allow-no-tokenizer" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [without_tokenizer]
    code, out_text, err = run(monkeypatch, capsys, "convert", str(without_tokenizer), "-o", str(out),
                              "--allow-no-tokenizer")
    assert code == 0, err
    assert edgemoe.load(out).logits([1, 2, 3]).shape[0] == 3          # token ids run
    code, out_text, err = run(monkeypatch, capsys, "run", str(out), "-p", "x")
    assert code == 2 and "no tokenizer.json" in err


def test_calibration_text_needs_the_tokenizer_even_when_allowed_without(monkeypatch, capsys, without_tokenizer,
                                                                         tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text(FILLER)
    code, _, err = run(monkeypatch, capsys, "convert", str(without_tokenizer), "-o", str(tmp_path / "store"),
                       "--allow-no-tokenizer", "--calib", str(calib))
    assert code == 2 and "tokenizer.json" in err and "--calib" in err, err
    assert not (tmp_path / "store").exists()
