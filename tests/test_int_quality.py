"""The integer path on a trained model: the bundled model's INT4 store, float vs integer experts.

Greedy decoding is compared token by token: the paths may only part where the float model is at a
near-tie (top-2 logits within NEAR_TIE), since int8 activations move the logits by a few hundredths.
Measured on this machine (dense weights float32, 100 new tokens per prompt): the first prompt parts
at its 2nd token (float margin 0.004), the second at its 36th (margin 6e-5), the third never.
Perplexity on a fixed 3000-character slice of eval.txt moves by at most 0.5% (measured +0.05% on
the first 20000 characters; docs/benchmarks.md has the full eval).
"""

import pytest
import torch

import edgemoe
from edgemoe.bundled import bundled_model_path, bundled_text
from edgemoe.evaluate import evaluate_text
from edgemoe.generate import GenerationOptions, stream_tokens
from edgemoe.kernels import set_threads
from edgemoe.convert import convert

PROMPTS = ("ROMEO:\nBut, soft! what light", "To be, or not to be", "KING HENRY:\nOnce more unto the breach")
NEAR_TIE = 0.01


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One thread (results do not depend on it): this model's kernels are too small to gain from two,
    and on a shared machine a parallel region waits for a descheduled thread."""
    store = tmp_path_factory.mktemp("bundled") / "int4"
    convert(bundled_model_path(), store, bits=4)
    set_threads(1)
    yield {c: edgemoe.load(store, torch.float32, compute=c) for c in ("fused-float", "fused-int")}
    set_threads()


def top2_margin(model, ids) -> float:
    cache = model.new_cache()
    model.logits(torch.tensor(ids[:-1]), cache)
    top = model.logits(torch.tensor(ids[-1:]), cache)[-1].topk(2).values
    return (top[0] - top[1]).item()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_parts_only_at_a_near_tie(models, prompt):
    opts = GenerationOptions(max_new_tokens=100, temperature=0, stop_token_ids=[])
    prompt_ids = models["fused-float"].tokenizer.encode(prompt)
    ref, got = (list(stream_tokens(m, prompt_ids, opts)) for m in models.values())
    assert len(ref) == len(got) == 100
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if first is not None:
        assert top2_margin(models["fused-float"], prompt_ids + ref[:first]) <= NEAR_TIE


def test_perplexity_moves_by_at_most_half_a_percent(models):
    text = bundled_text("eval.txt").read_text()[:3000]
    ppl = {c: evaluate_text(m, text).perplexity for c, m in models.items()}
    assert abs(ppl["fused-int"] / ppl["fused-float"] - 1) <= 0.005
