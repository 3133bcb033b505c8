"""Generation options: sampling is seeded and respects top-k / top-p; stops; streaming; chat template."""

import pytest
import torch

import edgemoe
from edgemoe.generate import GenerationOptions, next_token
from edgemoe.tokenizer import StreamDecoder


@pytest.fixture(scope="module")
def model(tiny_model):
    return edgemoe.load(tiny_model("mixtral"))


def test_same_seed_same_text_and_other_seed_differs(model):
    a = model.generate("To be", max_new_tokens=30, temperature=1.5, seed=7, stop_token_ids=[])
    b = model.generate("To be", max_new_tokens=30, temperature=1.5, seed=7, stop_token_ids=[])
    c = model.generate("To be", max_new_tokens=30, temperature=1.5, seed=8, stop_token_ids=[])
    assert a == b and a != c


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    greedy = model.generate("To be", max_new_tokens=15, temperature=0, stop_token_ids=[])
    assert model.generate("To be", max_new_tokens=15, temperature=2.0, top_k=1, seed=1, stop_token_ids=[]) == greedy
    assert model.generate("To be", max_new_tokens=15, temperature=2.0, top_p=1e-6, seed=1, stop_token_ids=[]) == greedy


def test_top_k_and_top_p_only_sample_allowed_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    g = torch.Generator().manual_seed(0)
    top_k = {next_token(logits, GenerationOptions(temperature=5.0, top_k=2), g) for _ in range(300)}
    assert top_k == {0, 1}
    probs = torch.softmax(logits, -1)                     # 0.64, 0.24, 0.09, ...: top_p=0.8 keeps two
    assert probs[0] < 0.8 <= probs[0] + probs[1]
    top_p = {next_token(logits, GenerationOptions(temperature=1.0, top_p=0.8), g) for _ in range(300)}
    assert top_p == {0, 1}


def test_streamed_pieces_make_the_returned_text(model):
    pieces = []
    text = model.generate("All the", max_new_tokens=25, on_text=pieces.append, stop_token_ids=[])
    assert "".join(pieces) == text and len(pieces) > 1


def test_stop_string_ends_the_text_before_it_and_is_never_streamed(model):
    full = model.generate("All the", max_new_tokens=25, stop_token_ids=[])
    stop = full[5:8]
    pieces = []
    text = model.generate("All the", max_new_tokens=25, stop_token_ids=[], stop_strings=[stop], on_text=pieces.append)
    assert text == full[:full.index(stop)]
    assert "".join(pieces) == text


def test_stop_token_and_max_new_tokens(model):
    ids = model.tokenizer.encode("All the")
    free = list(edgemoe.generate.stream_tokens(model, ids, GenerationOptions(max_new_tokens=10, stop_token_ids=[])))
    assert len(free) == 10
    stopped = list(edgemoe.generate.stream_tokens(model, ids, GenerationOptions(max_new_tokens=10,
                                                                                stop_token_ids=[free[4]])))
    assert stopped == free[:free.index(free[4])]


def test_stream_decoder_never_splits_a_character(model):
    ids = model.tokenizer.encode("naïve café — ok", add_special_tokens=False)
    decoder = StreamDecoder(model.tokenizer)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == "naïve café — ok"
    assert all("\ufffd" not in p for p in pieces)


def test_chat_template_renders_messages(model):
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "USER: hi\nASSISTANT:"


@pytest.mark.parametrize("option", [dict(max_new_tokens=-1), dict(temperature=-0.5), dict(top_p=0.0), dict(top_k=-2)])
def test_bad_options_are_rejected_by_name(option):
    with pytest.raises(ValueError, match=next(iter(option))):
        GenerationOptions(**option)


def test_stream_decoder_pieces_equal_the_whole_decode_for_any_ids(model):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(3, model.tokenizer.vocab_size, (40,), generator=g).tolist()
        decoder = StreamDecoder(model.tokenizer)
        text = "".join(decoder.push(i) for i in ids) + decoder.flush()
        assert text == model.tokenizer.decode(ids)
