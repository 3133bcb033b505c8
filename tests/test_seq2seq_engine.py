"""Switch Transformers' decode engine (edgemoe/decode.py's EncoderDecoderEngine, edgemoe/kernels/
cpu_seq2seq.py): a decoder token's layers against the generic forward of the same quantized model, the
same bits whether the experts are resident or read, the commands' default, and the step's call counts."""

import pytest
import torch

import edgemoe
from edgemoe.convert import convert
from edgemoe.decode import EncoderDecoderEngine
from edgemoe.generate import Generation, GenerationOptions, step, stream_tokens
from edgemoe.kernels import cpu_seq2seq, int_paths
from edgemoe.kernels.ops import INT_PATH_ENV

from test_dispatch_counts import TorchCalls, numba_dispatches  # noqa: F401 (a fixture)
from test_switch import CONFIGS, DECODER_IDS, PROMPT, switch

# One decoder token, every expert resident: a dispatch per decoder layer (its attention blocks, and
# its dense MLP where it has one), one more per MoE layer (its block), and the LM head's (the final
# norm's kernel is bound by name in edgemoe.layers, out of the counter's reach, as for decoder-only
# models in tests/test_dispatch_counts.py).
RESIDENT_DISPATCHES = {"per layer": 1, "per MoE layer": 1, "per step": 1}
# Torch calls of that token, per decoder layer (74 measured on three decoder layers, the embedding, the
# LM head and the step's tensors included; the generic forward made 410).
TORCH_CALLS_PER_LAYER = 30


@pytest.fixture(scope="module")
def stores(tiny_model, tmp_path_factory):
    """config name -> an INT4 store of that Switch checkpoint."""
    made = {}
    for name in ("tied", "untied"):
        made[name] = tmp_path_factory.mktemp("switch-engine") / name
        convert(switch(tiny_model, **CONFIGS[name]), made[name], bits=4)
    made["bfloat16"] = tmp_path_factory.mktemp("switch-engine") / "bfloat16"
    convert(switch(tiny_model, dtype="bfloat16"), made["bfloat16"], bits=4)
    return made


def one_token_steps(model, ids, decoder_ids) -> torch.Tensor:
    """The decoder's logits [T, V], one decode() call per token."""
    state = model.start(model.encode(ids))
    return torch.cat([model.decode([token], state) for token in decoder_ids])


@pytest.mark.parametrize("config", ["tied", "untied"])
@pytest.mark.parametrize("dense_bits", [8, 4])
def test_the_engine_matches_the_generic_forward(stores, config, dense_bits, monkeypatch):
    """Same store, same quantized matrices: the engine's one-token steps against the generic forward's
    (the attention's products and softmax round differently: float32 rounding apart), and the same
    greedy tokens. The engine's kernel runs once per decoder layer and token."""
    with edgemoe.load(stores[config], compute="fused-int", dense_bits=dense_bits) as model:
        ids = model.tokenizer.encode(PROMPT)
        engine = model.decode_engine
        assert isinstance(engine, EncoderDecoderEngine)
        calls = []
        kernel = cpu_seq2seq.t5_decoder_layer_kernel
        monkeypatch.setattr(cpu_seq2seq, "t5_decoder_layer_kernel", lambda *a: calls.append(1) or kernel(*a))
        got = one_token_steps(model, ids, DECODER_IDS)
        opts = GenerationOptions(max_new_tokens=12)
        tokens = list(stream_tokens(model, ids, opts))
        assert len(calls) == len(model.decoder_range) * (len(DECODER_IDS) + len(tokens))
        model.decode_engine = None
        expected = one_token_steps(model, ids, DECODER_IDS)
        assert list(stream_tokens(model, ids, opts)) == tokens
    assert (got - expected).abs().max() <= 2e-5 * expected.abs().max()


def test_a_bfloat16_checkpoint_decodes_alike(stores):
    """A bfloat16 checkpoint's store (its dense matrices quantized from bfloat16; on a CPU with native
    bfloat16 a long step's GEMMs run in it): the engine against the generic forward as above."""
    with edgemoe.load(stores["bfloat16"], compute="fused-int", dense_bits=8) as model:
        assert isinstance(model.decode_engine, EncoderDecoderEngine)
        ids = model.tokenizer.encode(PROMPT)
        got = one_token_steps(model, ids, DECODER_IDS)
        model.decode_engine = None
        expected = one_token_steps(model, ids, DECODER_IDS)
    assert (got - expected).abs().max() <= 2e-5 * expected.abs().max()


def test_the_engine_reads_the_bias_of_distances_past_the_last_bucket(stores):
    """Decoder positions past relative_attention_max_distance (20 in the tiny checkpoint) all take the
    last bucket: the engine's table holds the distances up to it and clamps longer ones there, as
    T5's buckets do (against the generic forward's bias, computed per position)."""
    with edgemoe.load(stores["tied"], compute="fused-int", dense_bits=8) as model:
        assert model.stacks.relative_attention_max_distance < 30
        ids, decoder_ids = model.tokenizer.encode(PROMPT), [(7 * i) % 200 + 2 for i in range(48)]
        got = one_token_steps(model, ids, decoder_ids)
        model.decode_engine = None
        expected = one_token_steps(model, ids, decoder_ids)
    assert (got - expected).abs().max() <= 2e-5 * expected.abs().max()


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("checkpoint", ["tied", "bfloat16"])
def test_experts_resident_or_read_give_the_same_bits(stores, monkeypatch, path, checkpoint):
    """The tiering invariant: every expert resident (the MoE block in the engine's one call) or a small
    RAM tier (the generic block on the engine's routing, experts read): the same logits, bit for bit,
    on each integer path this CPU runs (forced), from a float32 and a bfloat16 checkpoint."""
    monkeypatch.setenv(INT_PATH_ENV, path)
    moe_calls = []
    moe = EncoderDecoderEngine.moe
    monkeypatch.setattr(EncoderDecoderEngine, "moe", lambda *a, **k: moe_calls.append(1) or moe(*a, **k))
    results = {}
    for ram in ("100%", "20%"):
        with edgemoe.load(stores[checkpoint], compute="fused-int", dense_bits=8, ram=ram) as model:
            for entry in model.store.experts() if ram == "100%" else ():
                model.store.get(*entry.key)
            before = len(moe_calls)
            results[ram] = one_token_steps(model, model.tokenizer.encode(PROMPT), DECODER_IDS)
            moe_layers = sum(model.spec.moe_layers[l] for l in model.decoder_range)
            assert len(moe_calls) - before == (moe_layers * len(DECODER_IDS) if ram == "100%" else 0)
            if ram == "20%":
                assert model.store.stats.tiers["ram"].evictions > 0
    assert torch.equal(results["100%"], results["20%"])


def test_the_commands_default_runs_the_engine(stores):
    """dense_bits "auto" (the commands' default) quantizes an INT4 store's dense matrices at 4 bits, and
    the engine decodes; as stored, the generic forward does."""
    with edgemoe.load(stores["tied"], dense_bits="auto") as model:
        assert model.dense_bits == 4 and isinstance(model.decode_engine, EncoderDecoderEngine)
    with edgemoe.load(stores["tied"], dense_bits="none") as model:
        assert model.dense_bits is None and model.decode_engine is None


def test_a_decoder_token_is_one_call_a_layer(stores, numba_dispatches, monkeypatch):
    """A dispatch per decoder layer and one more per MoE layer (counted, not timed); the torch calls
    of the step stay few (the embedding, the LM head, the step's arrays and the hooks' views)."""
    dispatcher = numba_dispatches   # counts the kernels of cpu, cpu_int and cpu_layer; this one too:
    kernel = cpu_seq2seq.t5_decoder_layer_kernel
    monkeypatch.setattr(cpu_seq2seq, "t5_decoder_layer_kernel",
                        lambda *args: dispatcher.update(calls=dispatcher["calls"] + 1) or kernel(*args))
    with edgemoe.load(stores["tied"], compute="fused-int", dense_bits=8) as model:
        for entry in model.store.experts():
            model.store.get(*entry.key)
        state = model.start(model.encode(model.tokenizer.encode(PROMPT)))
        for token in DECODER_IDS[:3]:
            model.decode([token], state)
        before = dispatcher["calls"]
        with TorchCalls() as step:
            model.decode([DECODER_IDS[3]], state)
        layers = len(model.decoder_range)
        moe_layers = sum(model.spec.moe_layers[l] for l in model.decoder_range)
    expected = (RESIDENT_DISPATCHES["per layer"] * layers + RESIDENT_DISPATCHES["per MoE layer"] * moe_layers
                + RESIDENT_DISPATCHES["per step"])
    assert dispatcher["calls"] - before == expected
    assert step.count <= TORCH_CALLS_PER_LAYER * layers, step.count


def test_a_suspended_generation_opens_again_with_its_output_and_goes_on_as_before(stores):
    """Generation.suspend drops the decoder's state; the next step encodes the prompt again and feeds
    the start token and the output so far: the greedy tokens are those of a generation never suspended."""
    with edgemoe.load(stores["untied"]) as model:
        ids = model.tokenizer.encode(PROMPT)
        opts = GenerationOptions(max_new_tokens=10, stop_token_ids=[])
        whole = Generation(model, ids, opts)
        while not whole.finished:
            step(model, [whole])
        suspended = Generation(model, ids, opts)
        for _ in range(4):
            step(model, [suspended])
        suspended.suspend()
        assert suspended.feed is None
        assert suspended.open().pending == [model.stacks.decoder_start_token_id, *suspended.output]
        while not suspended.finished:
            step(model, [suspended])
        assert suspended.output == whole.output and len(whole.output) == 10
