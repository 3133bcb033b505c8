"""Beam search (edgemoe/beam.py) against transformers' own beam search on the same checkpoint,
float32; its beams batched through each layer (each expert read at most once per step); one beam is
greedy generation; the context limit; `edgemoe run --beams`."""

import sys

import pytest
import torch
import transformers

import edgemoe
from edgemoe.beam import beam_search
from edgemoe.cli import main
from edgemoe.convert import convert
from edgemoe.generate import GenerationOptions, generate_batch
from edgemoe.options import OptionError

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    return tiny_model("mixtral")


@pytest.fixture(scope="module")
def models(checkpoint):
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                                  experts_implementation="eager").eval()
    return reference, edgemoe.load(checkpoint)


@pytest.fixture(scope="module")
def prompt(models):
    vocab = models[1].spec.vocab_size
    return torch.randint(3, vocab, (7,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def stop_token(models, prompt):
    """A token the beams reach early: the second token of the best of 4 hypotheses without stop tokens,
    so hypotheses finish at different lengths and early_stopping changes the result."""
    best = beam_search(models[1], prompt, 4, NEW_TOKENS, stop_token_ids=[])[0][0]
    return best[1]


def transformers_beams(reference, prompt, num_beams, length_penalty, early_stopping, stop):
    """transformers' hypotheses, best first, as (new token ids without the stop token, score)."""
    out = reference.generate(torch.tensor([prompt]), num_beams=num_beams, do_sample=False,
                             num_return_sequences=num_beams, max_new_tokens=NEW_TOKENS,
                             length_penalty=length_penalty, early_stopping=early_stopping,
                             eos_token_id=stop, pad_token_id=stop, output_scores=True,
                             return_dict_in_generate=True)
    hypotheses = []
    for sequence, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        end = sequence.index(stop) if stop in sequence else len(sequence)   # the stop token, then padding
        hypotheses.append((sequence[:end], score))
    return hypotheses


SETTINGS = [(n, lp, es) for n in (2, 4) for lp in (1.0, 0.5) for es in (False, True)]


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping", SETTINGS)
def test_beams_equal_transformers_beam_search(models, prompt, stop_token, num_beams, length_penalty,
                                              early_stopping):
    reference, ours = models
    expected = transformers_beams(reference, prompt, num_beams, length_penalty, early_stopping, stop_token)
    got = beam_search(ours, prompt, num_beams, NEW_TOKENS, length_penalty, early_stopping,
                      stop_token_ids=[stop_token])
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert [score for _, score in got] == pytest.approx([score for _, score in expected], abs=1e-4)


def test_the_stop_token_ends_hypotheses_and_early_stopping_matters(models, prompt, stop_token):
    """The parity cases above cover both ways a hypothesis ends, and the done rule's two branches."""
    ours = models[1]
    late = beam_search(ours, prompt, 2, NEW_TOKENS, early_stopping=False, stop_token_ids=[stop_token])
    early = beam_search(ours, prompt, 2, NEW_TOKENS, early_stopping=True, stop_token_ids=[stop_token])
    assert any(len(tokens) < NEW_TOKENS for tokens, _ in early)        # ended by the stop token
    assert late != early


def test_without_stop_tokens_every_beam_runs_to_the_limit(models, prompt):
    reference, ours = models
    unused = ours.spec.vocab_size - 1
    got = beam_search(ours, prompt, 3, NEW_TOKENS, stop_token_ids=[unused])
    expected = transformers_beams(reference, prompt, 3, 1.0, False, unused)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert all(len(tokens) == NEW_TOKENS for tokens, _ in got)


def test_one_beam_is_greedy_generation(models, prompt, stop_token):
    ours = models[1]
    for stops in ([], [stop_token]):
        greedy = generate_batch(ours, [prompt], GenerationOptions(max_new_tokens=NEW_TOKENS, stop_token_ids=stops))
        [(tokens, _)] = beam_search(ours, prompt, 1, NEW_TOKENS, stop_token_ids=stops)
        assert tokens == greedy[0]


def test_beams_run_in_one_forward_step_reading_each_expert_at_most_once(checkpoint, prompt, tmp_path):
    store = tmp_path / "store"
    convert(checkpoint, store, bits=4)
    with edgemoe.load(store, preload="none") as model:
        steps = []                          # (segments, expert requests) per forward call
        forward = model.forward

        def counted(tokens, segments, last_only=False, **options):
            before = model.store.stats.requests
            logits = forward(tokens, segments, last_only, **options)
            steps.append((len(segments), model.store.stats.requests - before))
            return logits

        model.forward = counted
        hypotheses = beam_search(model, prompt, 4, NEW_TOKENS, stop_token_ids=[])
    spec = model.spec
    assert len(steps) == NEW_TOKENS                       # the prefill, then one step per further token
    assert all(segments == 4 for segments, _ in steps[1:])
    assert all(requests <= spec.num_layers * spec.num_experts for _, requests in steps)
    assert len(hypotheses) == 4


def test_caches_are_forked_only_for_a_parent_picked_again(models, prompt, monkeypatch):
    """Each step's beams hold distinct caches; a cache carried on from the step before is a parent's
    first pick, every other one is a fork, and there is one fork per new cache (no copy is wasted)."""
    from edgemoe.kv_cache import KVCache
    ours = models[1]
    forks, steps = [], []
    fork = KVCache.fork
    monkeypatch.setattr(KVCache, "fork", lambda cache: forks.append(fork(cache)) or forks[-1])
    forward = ours.forward
    monkeypatch.setattr(ours, "forward", lambda tokens, segments, last_only=False, **options: (
        steps.append([s.cache for s in segments]), forward(tokens, segments, last_only, **options))[1])
    beam_search(ours, prompt, 4, NEW_TOKENS, stop_token_ids=[])
    decode = steps[1:]                                  # steps[0] is the prefill
    carried = [len({id(c) for c in now} & {id(c) for c in before}) for before, now in zip(decode, decode[1:])]
    assert all(len({id(c) for c in step}) == len(step) == 4 for step in decode)
    assert {id(c) for step in decode for c in step} - {id(steps[0][0])} == {id(f) for f in forks}
    assert len(forks) == 3 + sum(4 - n for n in carried)       # the first step: the prompt's cache + 3 forks
    assert sum(carried) > 0


def test_beams_stop_at_the_context(tiny_model, prompt):
    model = edgemoe.load(tiny_model("mixtral", max_position_embeddings=16))
    warnings = []
    hypotheses = beam_search(model, prompt, 2, 30, stop_token_ids=[], warn=warnings.append)
    assert [len(tokens) for tokens, _ in hypotheses] == [16 - len(prompt)] * 2
    assert len(warnings) == 1 and "context of 16" in warnings[0]


def test_bad_arguments_are_named(models, prompt):
    ours = models[1]
    with pytest.raises(OptionError, match="num_beams=0"):
        beam_search(ours, prompt, 0, 4)
    with pytest.raises(OptionError, match="length_penalty=nan"):
        beam_search(ours, prompt, 2, 4, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="prompt is empty"):
        beam_search(ours, [], 2, 4)


def test_run_with_beams_prints_the_best_beam(monkeypatch, capsys, checkpoint, models):
    ours = models[1]
    text = "To be"
    best = beam_search(ours, ours.tokenizer.encode(text), 3, 8)[0][0]
    monkeypatch.setattr(sys, "argv", ["edgemoe", "run", str(checkpoint), "-p", text, "-n", "8", "--beams", "3"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == text + ours.tokenizer.decode(best) + "\n"
