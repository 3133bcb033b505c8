"""Sequences decoded together: in a step that takes one token of each sequence, each token's attention
block is the decode engine's, as in its step alone, and the MoE block serves them all. Each sequence's
logits are then bit for bit those of its steps alone, whoever shares them, on every architecture the
engine runs, on every integer path this CPU runs, in both dense dtypes: a served request's output does
not depend on the others in its steps (as long as each expert computes on the path it takes for one
token: fused-int, for the few tokens of these steps)."""

import pytest
import torch

import edgemoe
from edgemoe.convert import convert
from edgemoe.dense import KERNEL_MAX_TOKENS
from edgemoe.engine import Engine
from edgemoe.generate import GenerationOptions, generate_batch
from edgemoe.kernels.ops import INT_PATH_ENV, int_paths
from edgemoe.model import Segment
from edgemoe.quantized import StoreExperts

ARCHS = [("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}), ("olmoe", {}), ("gpt_oss", {}), ("phimoe", {}),
         ("deepseek_v2", {}), ("deepseek_v3", {}), ("mixtral", {"sliding_window": 3})]
PROMPTS = [[1, 5, 9, 2, 7], [4, 4, 8], [11, 3, 6, 2, 2, 9, 1]]


def prefilled(model, prompts):
    """Each prompt in a cache of its own, prefilled alone: (caches, each one's greedy next token)."""
    caches = [model.new_cache() for _ in prompts]
    tokens = [int(model.forward(torch.tensor(p), [Segment(c, len(p))], last_only=True)[-1].argmax())
              for p, c in zip(prompts, caches)]
    return caches, tokens


def decode_alone_and_together(model, prompts, steps):
    """Greedy decoding of each prompt alone, and of all of them in steps of one token each from caches
    prefilled alike, fed the tokens the runs alone chose: each step's logits [len(prompts), V], alone
    and together."""
    alone_caches, tokens = prefilled(model, prompts)
    together_caches, _ = prefilled(model, prompts)
    pairs = []
    for _ in range(steps):
        alone = torch.cat([model.forward(torch.tensor([t]), [Segment(c, 1)], last_only=True)
                           for t, c in zip(tokens, alone_caches)])
        together = model.forward(torch.tensor(tokens), [Segment(c, 1) for c in together_caches], last_only=True)
        pairs.append((alone, together))
        tokens = alone.argmax(-1).tolist()
    return pairs


@pytest.mark.parametrize("arch, overrides", ARCHS)
def test_each_sequence_decoded_together_has_the_logits_it_has_alone(tiny_model, tmp_path, arch, overrides):
    store = tmp_path / arch
    convert(tiny_model(arch, **overrides), store, bits=4)
    with edgemoe.load(store, dense_bits=8, compute="fused-int") as model:
        assert model.decode_engine is not None
        for alone, together in decode_alone_and_together(model, PROMPTS, 6):
            assert torch.equal(alone, together)


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v2"])   # a gated shared expert; a dense first layer
def test_more_sequences_than_a_quantized_matrix_multiplies_at_once_each_decode_as_alone(tiny_model, tmp_path, arch):
    """20 sequences in a step: past the rows a quantized matrix multiplies on its integer kernel at once
    (edgemoe.dense.KERNEL_MAX_TOKENS), the dense MLP, shared expert and head of the decoding rows still
    take them a few at a time, as their steps alone do."""
    assert len(PROMPTS) * 7 > max(KERNEL_MAX_TOKENS.values())
    store = tmp_path / arch
    convert(tiny_model(arch), store, bits=4)
    prompts = [[*p, i] for p in PROMPTS for i in range(7)]
    with edgemoe.load(store, dense_bits=8, compute="fused-int") as model:
        for alone, together in decode_alone_and_together(model, prompts, 3):
            assert torch.equal(alone, together)


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ram", ["auto", 0])   # every expert resident (the one-call step alone), or none
def test_the_bundled_store_decodes_together_as_alone_on_every_integer_path(bundled_int4_store, monkeypatch, path, dtype, ram):
    """The bundled model's INT4 store as the commands load it, four prompts, 10 steps (logits compared bit
    for bit: a step that rounded otherwise would show at once)."""
    monkeypatch.setenv(INT_PATH_ENV, path)
    with edgemoe.load(bundled_int4_store, dtype, dense_bits="auto", ram=ram) as model:
        prompts = [model.tokenizer.encode(p) for p in ("ROMEO:", "To be, or not to be", "First Citizen:", "KING HENRY")]
        for alone, together in decode_alone_and_together(model, prompts, 10):
            assert torch.equal(alone, together)
        assert model.store.holds_everything() == (ram == "auto")   # the bundled store fits any machine's RAM


def fused_below_four(self, bits, tokens, nbytes=0):
    """A latency model's choice with its crossover held at four tokens: fewer on "fused-int" (int8
    activations), more on "dequant" (float32 products), whatever this machine measures."""
    return "fused-int" if tokens < 4 else "dequant"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v2"])   # plain; a shared expert; dense first layers
def test_prompt_chunks_beside_decoding_sequences_leave_each_as_alone(tiny_model, tmp_path, monkeypatch, arch):
    """A step with two prompt chunks (12 and 7 tokens) and two decoding sequences: the decoding tokens'
    attention by the engine and their experts on the path one token takes ("fused-int"), each chunk's
    experts on the path chosen for its own count, though the step's joint counts would send them
    elsewhere: all four have the logits they have alone."""
    monkeypatch.setattr(StoreExperts, "choose", fused_below_four)
    store = tmp_path / arch
    convert(tiny_model(arch), store, bits=4)
    chunks = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1]]
    with edgemoe.load(store, dense_bits=8, compute="auto") as model:
        caches, tokens = prefilled(model, PROMPTS[:2])
        alone = [model.forward(torch.tensor([t]), [Segment(c.fork(), 1)], last_only=True) for t, c in zip(tokens, caches)]
        alone += [model.forward(torch.tensor(chunk), [Segment(model.new_cache(), len(chunk))]) for chunk in chunks]
        segments = [Segment(caches[0], 1), Segment(model.new_cache(), 12), Segment(caches[1], 1),
                    Segment(model.new_cache(), 7)]
        together = model.forward(torch.tensor([tokens[0], *chunks[0], tokens[1], *chunks[1]]), segments)
        prompts_only = model.forward(torch.tensor(chunks[0] + chunks[1]),
                                     [Segment(model.new_cache(), 12), Segment(model.new_cache(), 7)])
    assert torch.equal(together, torch.cat([alone[0], alone[2], alone[1], alone[3]]))
    assert torch.equal(prompts_only, torch.cat(alone[2:]))


def test_served_requests_in_a_burst_and_joining_later_give_their_text_alone(bundled_int4_store):
    """The engine on the bundled INT4 store: two requests arriving together (their prompts fed in one
    step), then others joining one after another, each prefilling beside the others' decoding: each
    gets its greedy tokens alone."""
    opts = GenerationOptions(max_new_tokens=24, temperature=0.0, stop_token_ids=[])
    texts = ["ROMEO:", "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
             "First Citizen:\nBefore we proceed any further, hear me speak.", "KING HENRY"]
    with edgemoe.load(bundled_int4_store, dense_bits="auto") as model:
        prompts = [model.tokenizer.encode(t) for t in texts]
        engine = Engine(model)
        requests = [engine.submit(prompts[0], opts)]
        for prompt in prompts[1:]:
            requests.append(engine.submit(prompt, opts))
            for _ in range(5):
                engine.step()
        while engine.step():
            pass
        assert [r.output_ids for r in requests] == [generate_batch(model, [p], opts)[0] for p in prompts]
