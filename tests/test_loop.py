"""The one generation loop (edgemoe/generate.py): plain, batched, served and speculative decoding, beam
search and the encoder-decoder model all go through its Generation (stops, limit, stop strings,
sampler) and its forward step, so each rule behaves the same whichever driver runs it."""

import pytest
import torch

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.engine import Engine
from edgemoe.generate import Generation, GenerationOptions, generate, generate_batch, stream_tokens
from edgemoe.speculative import Speculator, self_draft

PROMPT = "ROMEO:"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    with edgemoe.load(bundled_model_path(), dtype=torch.float32) as m:
        yield m


@pytest.fixture(scope="module")
def free(model):
    """The greedy tokens of PROMPT without stops, and each one's text."""
    tokens = list(stream_tokens(model, model.tokenizer.encode(PROMPT),
                                GenerationOptions(max_new_tokens=NEW_TOKENS, stop_token_ids=[])))
    return tokens, [model.tokenizer.decode(tokens[:i + 1])[len(model.tokenizer.decode(tokens[:i])):]
                    for i in range(len(tokens))]


def split_stop(pieces):
    """(i, stop): a stop string made of the end of token i's text and the start of token i + 1's, so
    that it is split across two streamed tokens, and appears in the text first there."""
    text = "".join(pieces)
    for i in range(len(pieces) - 1):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2:
            stop = pieces[i][-2:] + pieces[i + 1][:2]
            end = len("".join(pieces[:i + 1]))
            if text.index(stop) == end - 2:
                return i, stop
    raise AssertionError("no token boundary to split a stop string across")


def engine_run(model, ids, opts):
    engine = Engine(model)
    request = engine.submit(ids, opts)
    while engine.step():
        pass
    return request, list(request.events())


def test_a_stop_string_split_across_two_tokens_ends_every_driver_alike(model, free):
    tokens, pieces = free
    i, stop = split_stop(pieces)
    full = "".join(pieces)
    expected_text = full[:full.index(stop)]
    ids = model.tokenizer.encode(PROMPT)
    opts = GenerationOptions(max_new_tokens=NEW_TOKENS, stop_token_ids=[], stop_strings=[stop])

    def shown(decoder=None):
        streamed = []
        drivers = {"decoder": decoder} if decoder else {}
        text = generate(model, ids, on_text=streamed.append, temperature=0, max_new_tokens=NEW_TOKENS,
                        stop_token_ids=[], stop_strings=[stop], **drivers)
        return text, streamed

    speculator = Speculator(model, self_draft(model), 3, shares_cache=True)
    for text, streamed in (shown(), shown(speculator.decode)):
        assert text == expected_text and "".join(streamed) == text     # the held-back start never shown
    request, events = engine_run(model, ids, opts)
    assert "".join(e.text for e in events) == expected_text and events[-1].finish_reason == "stop"
    # Token ids: every driver ends at the token that completes the stop string, and takes it.
    ended = tokens[:i + 2]
    assert request.output_ids == ended
    assert list(stream_tokens(model, ids, opts)) == ended
    assert list(speculator.stream(ids, opts)) == ended
    assert generate_batch(model, [ids, ids], opts) == [ended, ended]


def test_every_driver_takes_its_tokens_through_the_generations_accept(model, free, monkeypatch):
    """One place decides stops and limits: each driver's tokens pass through Generation.accept, the
    stop token included (not output)."""
    tokens, _ = free
    stop = tokens[9]
    expected = tokens[:tokens.index(stop)]
    seen = []
    accept = Generation.accept
    monkeypatch.setattr(Generation, "accept", lambda self, token: seen.append(token) or accept(self, token))
    ids = model.tokenizer.encode(PROMPT)
    opts = GenerationOptions(max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    runs = {"plain": lambda: list(stream_tokens(model, ids, opts)),
            "batch": lambda: generate_batch(model, [ids], opts)[0],
            "engine": lambda: engine_run(model, ids, opts)[0].output_ids,
            "speculative": lambda: list(Speculator(model, self_draft(model), 4, shares_cache=True).stream(ids, opts))}
    for name, run in runs.items():
        seen.clear()
        assert run() == expected, name
        assert seen == expected + [stop], name


def test_seeded_sampling_does_not_depend_on_the_batch_in_any_driver(model):
    """Each generation draws from its own seeded generator: a batch's sequences sample as each alone."""
    prompts = [model.tokenizer.encode(p) for p in ("ROMEO:", "JULIET:\nO", "To be, or not to be")]
    sampled = GenerationOptions(max_new_tokens=12, temperature=1.0, top_k=40, seed=11, stop_token_ids=[])
    alone = [list(stream_tokens(model, p, sampled)) for p in prompts]
    assert generate_batch(model, prompts, sampled) == alone
    engine = Engine(model)
    requests = [engine.submit(p, sampled) for p in prompts]
    while engine.step():
        pass
    assert [r.output_ids for r in requests] == alone


@pytest.fixture(scope="module")
def switch(tiny_model):
    return edgemoe.load(tiny_model("switch_transformers"))


def test_an_encoder_decoder_model_goes_through_the_same_loop(switch, monkeypatch):
    """The decoder is fed by the loop's forward step (sequences batched as a decoder-only model's), and
    the context limit and its notice apply to it as to a decoder-only model."""
    prompts = [switch.tokenizer.encode(p)[:4] for p in ("translate English to German: the house", "summarize: a b")]
    opts = GenerationOptions(max_new_tokens=16, stop_token_ids=[], temperature=0.8, seed=2)
    alone = [list(stream_tokens(switch, p, opts)) for p in prompts]
    assert generate_batch(switch, prompts, opts) == alone and all(len(a) == 16 for a in alone)
    monkeypatch.setattr(switch, "context_length", 8)     # the decoder's positions end before max_new_tokens
    notices = []
    greedy = GenerationOptions(max_new_tokens=50, stop_token_ids=[])
    out = list(stream_tokens(switch, prompts[0], greedy, notices.append))
    assert len(out) == 7                                 # positions 0..7: the start token and 7 new ones
    assert len(notices) == 1 and "context of 8" in notices[0]
