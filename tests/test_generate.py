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


@pytest.fixture(scope="module")
def short_model(tiny_model):
    """A model whose context is 64 positions."""
    return edgemoe.load(tiny_model("mixtral", max_position_embeddings=64))


def prompt_of(model, n):
    return torch.randint(3, model.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_a_prompt_past_the_context_is_refused_naming_the_limit(short_model):
    from edgemoe.errors import ContextLengthError
    for run in (lambda o: list(edgemoe.generate.stream_tokens(short_model, prompt_of(short_model, 64), o)),
                lambda o: edgemoe.generate.generate_batch(short_model, [prompt_of(short_model, 64)], o)):
        with pytest.raises(ContextLengthError, match="64 tokens and the model's context is 64"):
            run(GenerationOptions(max_new_tokens=5))


def test_truncate_keeps_the_prompts_last_tokens(short_model):
    ids = prompt_of(short_model, 100)
    notices = []
    opts = GenerationOptions(max_new_tokens=10, stop_token_ids=[], truncate=True)
    cut = list(edgemoe.generate.stream_tokens(short_model, ids, opts, notices.append))
    assert cut == list(edgemoe.generate.stream_tokens(short_model, ids[-54:], opts))   # 64 - 10 new tokens
    assert len(notices) == 1 and "last 54 of 100 tokens" in notices[0]


def test_generation_ends_at_the_context(short_model):
    notices = []
    opts = GenerationOptions(max_new_tokens=10, stop_token_ids=[])
    single = list(edgemoe.generate.stream_tokens(short_model, prompt_of(short_model, 60), opts, notices.append))
    assert len(single) == 4 and "context of 64" in notices[0]
    batch = edgemoe.generate.generate_batch(short_model, [prompt_of(short_model, 60), prompt_of(short_model, 10)],
                                            opts, notices.append)
    assert [len(b) for b in batch] == [4, 10] and batch[0] == single


def test_run_refuses_or_truncates_a_long_prompt(tiny_model):
    import subprocess
    import sys
    path = str(tiny_model("mixtral", max_position_embeddings=64))
    prompt = "To be, or not to be, that is the question " * 20
    refused = subprocess.run([sys.executable, "-m", "edgemoe", "run", path, "-p", prompt, "-n", "4"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "the model's context is 64" in refused.stderr and "--truncate" in refused.stderr
    cut = subprocess.run([sys.executable, "-m", "edgemoe", "run", path, "-p", prompt, "-n", "4", "--truncate"],
                         capture_output=True, text=True)
    assert cut.returncode == 0 and "warning: prompt truncated from the left" in cut.stderr
