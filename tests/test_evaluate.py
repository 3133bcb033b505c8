"""`edgemoe eval`: perplexity, agreement and KL checked against plain torch on transformers' model."""

import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

import edgemoe
from edgemoe.cli import main
from edgemoe.evaluate import evaluate, windows

TEXT = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. " * 3


def reference_log_probs(path, ids):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    with torch.no_grad():
        return F.log_softmax(ref(ids[None]).logits[0], dim=-1)    # row t predicts token t + 1


def test_windows_score_every_position_once():
    for n, context, stride in [(10, 4, 2), (10, 4, 4), (100, 16, 5), (3, 8, 4), (17, 5, 1)]:
        scored = [p for _, end, first in windows(n, context, stride) for p in range(first, end)]
        assert scored == list(range(1, n))
        for begin, end, first in windows(n, context, stride):
            assert end - begin <= context and begin < first


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "phimoe", "gpt_oss"])
def test_perplexity_of_a_short_text_is_the_plain_cross_entropy(tiny_model, arch):
    path = tiny_model(arch)
    model = edgemoe.load(path)
    ids = torch.tensor(model.tokenizer.encode(TEXT, add_special_tokens=False))
    logp = reference_log_probs(path, ids)
    expected_nll = -logp[:-1].gather(1, ids[1:, None]).mean().item()
    result = evaluate(model, ids, context=len(ids))
    assert result.tokens == len(ids) - 1
    assert math.isclose(result.nll, expected_nll, rel_tol=1e-5)
    assert math.isclose(result.perplexity, math.exp(expected_nll), rel_tol=1e-5)


def test_sliding_windows_match_a_window_by_window_reference(tiny_model):
    path = tiny_model("mixtral")
    model = edgemoe.load(path)
    ids = torch.tensor(model.tokenizer.encode(TEXT, add_special_tokens=False))
    total, count = 0.0, 0
    for begin, end, first in windows(len(ids), 24, 10):
        logp = reference_log_probs(path, ids[begin:end])
        rows = torch.arange(first - begin - 1, end - begin - 1)
        total -= logp[rows].gather(1, ids[first:end, None]).sum().item()
        count += end - first
    result = evaluate(model, ids, context=24, stride=10)
    assert result.tokens == count and math.isclose(result.nll, total / count, rel_tol=1e-5)


def test_agreement_and_kl_against_a_reference(tiny_model):
    a = edgemoe.load(tiny_model("mixtral"))
    b = edgemoe.load(tiny_model("mixtral", seed=1))
    ids = torch.tensor(a.tokenizer.encode(TEXT, add_special_tokens=False))
    same = evaluate(a, ids, context=32, reference=a)
    assert same.top1_agreement == 1.0 and abs(same.kl) < 1e-6 and same.reference_perplexity == same.perplexity
    other = evaluate(a, ids, context=32, reference=b)
    log_a, log_b = F.log_softmax(a.logits(ids[:32]), -1), F.log_softmax(b.logits(ids[:32]), -1)
    first_window_kl = (log_b.exp() * (log_b - log_a)).sum(-1)[:-1].mean().item()
    assert other.kl > 0.01 and other.top1_agreement < 1.0
    assert math.isclose(other.reference_perplexity, evaluate(b, ids, context=32).perplexity, rel_tol=1e-6)
    assert first_window_kl > 0


def test_eval_command_states_the_context_and_prints_json(tiny_model, tmp_path, monkeypatch, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    path = tiny_model("mixtral")
    monkeypatch.setattr(sys, "argv", ["edgemoe", "eval", str(path), "--text", str(text), "--context", "40",
                                      "--reference", str(path)])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "context 40 tokens" in out and "top-1 agreement with reference: 1.0000" in out
    monkeypatch.setattr(sys, "argv", ["edgemoe", "eval", str(path), "--text", str(text), "--json"])
    with pytest.raises(SystemExit):
        main()
    record = json.loads(capsys.readouterr().out)
    assert record["context"] == 256 and record["perplexity"] > 1


def test_eval_of_a_missing_text_file_is_one_error_line(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["edgemoe", "eval", str(tiny_model("mixtral")), "--text", str(tmp_path / "no.txt")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "no.txt: text file not found" in err and "\n" not in err


def test_eval_defaults_to_the_bundled_model_and_its_held_out_text(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["edgemoe", "eval", "--context", "128", "--json"])
    with pytest.raises(SystemExit) as info:
        main()
    record = json.loads(capsys.readouterr().out)
    assert info.value.code == 0 and record["context"] == 128 and record["tokens"] > 10000
    assert record["perplexity"] < 200       # a trained model: far below its 4096-token vocabulary


def test_decode_mode_scores_the_same_tokens_as_the_batched_mode(tiny_model):
    from edgemoe.evaluate import evaluate
    model = edgemoe.load(tiny_model("mixtral"), torch.float32)
    ids = torch.randint(3, model.spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    batched = evaluate(model, ids, context=32, stride=16)
    stepped = evaluate(model, ids, context=32, stride=16, decode=True)
    assert stepped.tokens == batched.tokens and abs(stepped.nll - batched.nll) <= 1e-5
