"""Speculative decoding: greedy output equal to plain greedy decoding token for token (the bundled
model, from its checkpoint and from a store, self-draft and a separate draft); the rejection
sampler's output distribution equal to the target's; rollback of both caches; draft checks; under
a RAM budget, a self-draft that reads only the store's fallback copies, and speculation turned off
where it reads more than plain decoding."""

import shutil
import sys
import threading

import pytest
import torch

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.cli import main
from edgemoe.convert import convert
from edgemoe.errors import DraftError
from edgemoe.generate import Generation, GenerationOptions, decode, sampling_probs, stream_tokens
from edgemoe.speculative import (PROBE_TOKENS, FallbackDraftExperts, LowWidthExperts, Speculator, accept,
                                 check_draft, self_draft, speculator_for)
from helpers import run_cli

PROMPTS = ("ROMEO:", "To be, or not to be", "KING HENRY.\nNow")


@pytest.fixture(scope="module")
def bundled():
    with edgemoe.load(bundled_model_path(), dtype=torch.float32) as model:
        yield model


@pytest.fixture(scope="module")
def bundled_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "store"
    convert(bundled_model_path(), out, bits=4)
    return out


@pytest.fixture(scope="module")
def fallback_store(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "fallback"
    convert(bundled_model_path(), out, bits=4, fallback_bits=2)
    return out


def _greedy(max_new_tokens=24):
    return GenerationOptions(max_new_tokens=max_new_tokens, stop_token_ids=[])


@pytest.mark.parametrize("num_draft", [1, 3, 4])
def test_self_draft_greedy_equals_plain_greedy_on_the_bundled_checkpoint(bundled, num_draft):
    speculator = Speculator(bundled, self_draft(bundled), num_draft, shares_cache=True)
    for prompt in PROMPTS:
        ids = bundled.tokenizer.encode(prompt)
        assert list(speculator.stream(ids, _greedy())) == list(stream_tokens(bundled, ids, _greedy()))
    s = speculator.stats
    assert s.rounds and 0 < s.accepted < s.drafted   # the INT2 draft is right often, not always
    assert s.emitted == 3 * 24


@pytest.mark.parametrize("num_draft,ram,store", [(2, None, "bundled_store"), (4, "25%", "fallback_store")])
def test_self_draft_greedy_equals_plain_greedy_from_a_store(request, num_draft, ram, store):
    path = request.getfixturevalue(store)
    # One thread in both: torch's products round by thread count, and the automatic count follows
    # the machine's load, so two loads could otherwise differ before speculation is involved.
    with edgemoe.load(path, threads=1, ram=ram) as plain:
        expected = [list(stream_tokens(plain, plain.tokenizer.encode(p), _greedy())) for p in PROMPTS]
    with edgemoe.load(path, threads=1, ram=ram) as target:
        speculator = Speculator(target, self_draft(target), num_draft, shares_cache=True, probe_tokens=0)
        got = [list(speculator.stream(target.tokenizer.encode(p), _greedy())) for p in PROMPTS]
        assert got == expected
        s = speculator.stats
        assert s.prefetched_used <= s.prefetched and s.off is None
        if ram is not None:   # a quarter of the experts in RAM: the draft's routing finds some missing
            assert s.prefetched > 0 and s.prefetched_used > 0


def test_the_self_draft_reads_only_fallback_copies_and_holds_them_within_the_ram_budget(fallback_store):
    """The draft's own reads (the caller's thread while the draft runs; the loader's prefetches for
    the verification are the target's) are all fallback copies, cached in the RAM tier within --ram."""
    with edgemoe.load(fallback_store, threads=1, ram="25%") as target:
        store = target.store
        copies = {(e.file, e.offset) for e in store.manifest.fallback.values()}
        draft = self_draft(target)
        assert isinstance(draft.experts, FallbackDraftExperts)
        speculator = Speculator(target, draft, 3, shares_cache=True, probe_tokens=0)
        drafting, drafts_reads, main = [False], [], threading.current_thread()
        read, propose = store.disk.read, speculator._propose

        def counted_read(entry, **kwargs):
            if drafting[0] and threading.current_thread() is main:
                drafts_reads.append((entry.file, entry.offset))
            return read(entry, **kwargs)

        def flagged_propose(*args):
            drafting[0] = True
            try:
                return propose(*args)
            finally:
                drafting[0] = False

        store.disk.read, speculator._propose = counted_read, flagged_propose
        for prompt in PROMPTS:
            ids = target.tokenizer.encode(prompt)
            assert list(speculator.stream(ids, _greedy())) == list(stream_tokens(target, ids, _greedy()))
        assert drafts_reads and set(drafts_reads) <= copies
        assert store.stats.fallback_reads >= len(drafts_reads)
        assert store.stats.ram.peak_bytes <= store.ram_capacity
        assert speculator.stats.accepted > 0


def test_a_self_draft_without_fallback_copies_under_a_ram_budget_is_off_with_one_message(bundled_store):
    with edgemoe.load(bundled_store, threads=1, ram="25%") as target:
        with pytest.raises(DraftError, match="no fallback copies.*--fallback-bits 2"):
            self_draft(target)
        speculator = speculator_for(target, "self", 4)
        warnings, got = [], []
        for prompt in PROMPTS:
            ids = target.tokenizer.encode(prompt)
            got.append(list(speculator.stream(ids, _greedy(), warn=warnings.append)))
            assert got[-1] == list(stream_tokens(target, ids, _greedy()))
        assert len(warnings) == 1 and warnings[0].startswith("speculative decoding off: ")
        assert str(bundled_store) in warnings[0] and "--fallback-bits 2" in warnings[0]
        assert speculator.stats.rounds == 0 and speculator.stats.plain_tokens == 3 * 23


def test_speculation_reading_more_per_token_than_plain_decoding_is_turned_off_once(bundled, bundled_store):
    """A draft the target always rejects (the bundled checkpoint with its output head negated: it
    proposes the least likely token) and no expert in RAM: each round yields one token and reads the
    experts of all n + 1 verified positions, so speculation reads more per token than plain decoding,
    which reads one token's experts a step. The probe sees it, says so once, and decodes plainly."""
    with edgemoe.load(bundled_model_path(), dtype=torch.float32) as draft, \
            edgemoe.load(bundled_store, threads=1, ram=0) as target:
        draft.lm_head = -draft.lm_head
        speculator = Speculator(target, draft, 4)
        warnings = []
        for prompt in PROMPTS:
            ids = target.tokenizer.encode(prompt)
            got = list(speculator.stream(ids, _greedy(), warn=warnings.append))
            assert got == list(stream_tokens(target, ids, _greedy()))
        s = speculator.stats
        assert len(warnings) == 1 and warnings[0].startswith("speculative decoding off: it read ")
        assert s.off == warnings[0] and s.accepted == 0 and s.rounds == PROBE_TOKENS
        assert s.plain_tokens == 3 * 23 - s.rounds


PRECISIONS = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 8), (torch.bfloat16, 8),
              (torch.float32, 4)]


@pytest.mark.parametrize("source", ["checkpoint", "store"])
@pytest.mark.parametrize("dtype,dense_bits", PRECISIONS)
def test_verification_gives_the_bits_of_one_token_steps_in_every_precision(bundled_store, source, dtype, dense_bits):
    """The verification step's logits for [c, d1..dn] equal, bit for bit, those of feeding c, d1, ...
    one token per step: what makes greedy output plain greedy decoding's whatever the margins. A
    product over several rows rounds differently from one-row products (float32 by about 1e-5,
    bfloat16 by 0.06 in these logits, dense INT4's GEMM against its one-token kernel by as much):
    verification runs each token through each layer as its one-token step would."""
    path = bundled_model_path() if source == "checkpoint" else bundled_store
    with edgemoe.load(path, dtype, dense_bits=dense_bits, **({"preload": "none"} if source == "store" else {})) as m:
        ids = m.tokenizer.encode("JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father")
        stepped = m.new_cache()
        m.logits(ids[:6], stepped)
        one_by_one = torch.cat([m.logits([t], stepped) for t in ids[6:12]])
        verified = m.new_cache()
        m.logits(ids[:6], verified)
        speculator = Speculator(m, self_draft(m), 5, shares_cache=True)
        logits, _ = speculator._verify(ids[6:12], verified, greedy=True)
        assert torch.equal(logits, one_by_one)


@pytest.mark.parametrize("arch,overrides", [("mixtral", {"sliding_window": 4}), ("deepseek_v2", {}),
                                            ("gpt_oss", {}), ("qwen2_moe", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_gives_one_token_bits_for_every_attention_kind(tiny_model, arch, overrides, dtype):
    """Sliding windows (each query's own mask), latent attention, attention sinks, gated shared
    experts (whose silu over several rows vectorizes differently from one row: a per-product fix
    was not enough): verified positions equal one-token steps bit for bit (random tiny checkpoints)."""
    with edgemoe.load(tiny_model(arch, **overrides), dtype) as m:
        ids = list(range(3, 15))
        stepped = m.new_cache()
        m.logits(ids[:5], stepped)
        one_by_one = torch.cat([m.logits([t], stepped) for t in ids[5:]])
        verified = m.new_cache()
        m.logits(ids[:5], verified)
        logits, _ = Speculator(m, self_draft(m), 6, shares_cache=True)._verify(ids[5:], verified, greedy=True)
        assert torch.equal(logits, one_by_one)


@pytest.mark.parametrize("dtype,dense_bits", PRECISIONS)
def test_self_draft_greedy_equals_plain_greedy_in_every_precision(bundled_store, dtype, dense_bits):
    with edgemoe.load(bundled_store, dtype, dense_bits=dense_bits) as m:
        speculator = Speculator(m, self_draft(m), 4, shares_cache=True)
        for prompt in ("JULIET:", *PROMPTS):
            ids = m.tokenizer.encode(prompt)
            assert list(speculator.stream(ids, _greedy(30))) == list(stream_tokens(m, ids, _greedy(30)))


def test_separate_draft_with_its_own_cache_greedy_equals_plain(bundled, bundled_store):
    with edgemoe.load(bundled_store) as draft:
        check_draft(bundled, draft, str(bundled_store))
        speculator = Speculator(bundled, draft, 3)
        for prompt in PROMPTS:
            ids = bundled.tokenizer.encode(prompt)
            assert list(speculator.stream(ids, _greedy(30))) == list(stream_tokens(bundled, ids, _greedy(30)))
        assert speculator.stats.accepted > 0


def test_stop_tokens_and_the_token_limit_end_as_plain_decoding(bundled):
    ids = bundled.tokenizer.encode("ROMEO:")
    plain = list(stream_tokens(bundled, ids, _greedy(40)))
    stop = plain[17]
    opts = GenerationOptions(max_new_tokens=40, stop_token_ids=[stop])
    expected = list(stream_tokens(bundled, ids, opts))
    speculator = Speculator(bundled, self_draft(bundled), 4, shares_cache=True)
    assert list(speculator.stream(ids, opts)) == expected == plain[:plain.index(stop)]
    for limit in (0, 1, 2, 7):
        assert list(speculator.stream(ids, _greedy(limit))) == plain[:limit]


def test_caches_are_rolled_back_to_the_committed_tokens(bundled):
    ids = bundled.tokenizer.encode("ROMEO:")
    speculator = Speculator(bundled, self_draft(bundled), 4, shares_cache=True)
    opts = _greedy(16)
    generation = Generation(bundled, ids, opts)
    next(decode(generation))                 # the prompt, as plain decoding feeds it, to the first token
    cache, generator = generation.feed.state, generation.generator
    tokens = ids + generation.output
    while len(tokens) < len(ids) + 12:
        speculator._round(tokens, 4, cache, cache, opts, generator)
        assert cache.length == len(tokens) - 1
    # The rolled-back cache continues exactly as one built from the committed tokens alone.
    fresh = bundled.new_cache()
    bundled.logits(tokens[:-1], fresh)
    assert torch.allclose(bundled.logits(tokens[-1:], cache), bundled.logits(tokens[-1:], fresh), atol=1e-4)


# ---- the rejection sampler ------------------------------------------------------------------------
TRIALS = 8_000
TOLERANCE = 0.022   # about 4 standard deviations of a frequency over TRIALS draws (sd <= 0.0056)


def _one_round(target_logits, q, opts, generator):
    """A speculative round on fixed logits: proposals drawn from the draft's q, then accept()."""
    proposals = [int(torch.multinomial(row, 1, generator=generator)) for row in q]
    k, token = accept(target_logits, proposals, q, opts, generator)
    return (proposals[:k] + [token])


@pytest.mark.parametrize("opts", [GenerationOptions(temperature=1.0),
                                  GenerationOptions(temperature=0.7, top_k=4),
                                  GenerationOptions(temperature=1.3, top_p=0.8)])
def test_rejection_sampling_keeps_the_targets_distribution(opts):
    g = torch.Generator().manual_seed(0)
    vocab = 6
    target_logits = torch.randn(3, vocab, generator=g) * 1.5    # positions 1, 2 and the bonus one
    draft_logits = target_logits[:2] + 2 * torch.randn(2, vocab, generator=g)   # a draft that is often wrong
    p = torch.stack([sampling_probs(row, opts) for row in target_logits])
    q = torch.stack([sampling_probs(row, opts) for row in draft_logits])
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)      # given the first proposal accepted
    for _ in range(TRIALS):
        out = _one_round(target_logits, q, opts, g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert (first / TRIALS - p[0]).abs().max() < TOLERANCE
    assert second.sum() > TRIALS / 4   # about half the first proposals are accepted
    assert (second / second.sum() - p[1]).abs().max() < 2 * TOLERANCE
    # The test can fail: a sampler that resampled from p (not norm(max(0, p - q))) after a rejection
    # would give q min(1, p/q) + (1 - acceptance) p for the first token, this far from p:
    q = sampling_probs(draft_logits[0], opts)
    kept = torch.minimum(q, p[0])
    naive = kept + (1 - kept.sum()) * p[0]
    assert (naive - p[0]).abs().max() > 3 * TOLERANCE


def test_greedy_accept_takes_proposals_while_they_are_the_targets_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 2.0]])   # argmax 1, 0, 2
    g = torch.Generator()
    assert accept(logits, [1, 0], None, GenerationOptions(), g) == (2, 2)
    assert accept(logits, [1, 2], None, GenerationOptions(), g) == (1, 0)
    assert accept(logits, [2, 0], None, GenerationOptions(), g) == (0, 1)


# ---- the draft ------------------------------------------------------------------------------------
def test_a_draft_with_another_tokenizer_is_refused(bundled, tiny_model):
    other = tiny_model("mixtral")
    with edgemoe.load(other) as draft:
        with pytest.raises(DraftError, match=f"{other}.*vocabulary"):
            check_draft(bundled, draft, str(other))


def test_a_draft_with_the_same_vocabulary_but_another_tokenizer_json_is_refused(bundled, tmp_path):
    import json
    copy = tmp_path / "draft"
    shutil.copytree(bundled_model_path(), copy)
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    with edgemoe.load(copy) as draft:
        with pytest.raises(DraftError, match="tokenizer.json differs"):
            check_draft(bundled, draft, str(copy))


def test_the_self_drafts_copy_stays_within_its_cap(bundled):
    full = self_draft(bundled)
    ids = bundled.tokenizer.encode("ROMEO:")
    list(Speculator(bundled, full, 4, shares_cache=True).stream(ids, _greedy(8)))
    one = max(c.nbytes for c in full.experts.copies.values())
    capped = self_draft(bundled, capacity=3 * one)
    speculator = Speculator(bundled, capped, 4, shares_cache=True)
    assert list(speculator.stream(ids, _greedy(8))) == list(stream_tokens(bundled, ids, _greedy(8)))
    experts: LowWidthExperts = capped.experts
    assert experts.nbytes <= 3 * one and len(experts.copies) <= 3
    assert experts.built > len(experts.copies)    # dropped copies were made again
    # INT2 codes, plus a float32 scale and zero per DRAFT_GROUP weights: about 3 bits per weight.
    s = bundled.spec
    weights = 3 * s.expert_hidden * s.hidden_size
    assert weights * 2 / 8 < one < weights * 3.5 / 8


# ---- the command line -----------------------------------------------------------------------------
def test_run_with_a_self_draft_prints_plain_greedy_text_and_its_figures(monkeypatch, capsys):
    def run(*args):
        monkeypatch.setattr(sys, "argv", ["edgemoe", "run", "-p", "ROMEO:", "-n", "20", "--temperature", "0", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 0
        return capsys.readouterr()

    plain = run().out
    out, err = run("--draft", "self", "--speculate", "3", "--stats")
    assert out == plain and len(plain) > 20
    assert "speculation:" in err and "acceptance" in err and "INT2 draft copy" in err


def test_run_says_once_that_a_self_draft_without_fallback_copies_is_off(monkeypatch, capsys, bundled_store):
    def run(*args):
        monkeypatch.setattr(sys, "argv", ["edgemoe", "run", str(bundled_store), "-p", "ROMEO:", "-n", "12",
                                          "--ram", "25%", "--threads", "1", "--temperature", "0", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 0
        return capsys.readouterr()

    plain = run().out
    out, err = run("--draft", "self")
    assert out == plain and err.count("warning: ") == 1
    assert "warning: speculative decoding off: " in err and "--fallback-bits 2" in err


@pytest.mark.parametrize("args,message", [
    (["--draft", "self", "--beams", "2"], "--draft 'self': cannot act with --beams"),
    (["--speculate", "3"], "--speculate 3: only with --draft"),
    (["--draft", "x", "--draft-ram", "1MiB"], "--draft-ram 1048576: only with --draft self"),
    (["--draft", "self", "--draft-ram", "lots"], "--draft-ram 'lots': expected a size"),
])
def test_run_refuses_bad_draft_flags(monkeypatch, capsys, args, message):
    status, err = run_cli(monkeypatch, capsys, "run", "-p", "ROMEO:", "-n", "2", *args)
    assert status == 2 and message in err


def test_run_refuses_a_draft_with_another_tokenizer(monkeypatch, capsys, tiny_model):
    other = tiny_model("mixtral")
    status, err = run_cli(monkeypatch, capsys, "run", "-p", "ROMEO:", "-n", "2", "--draft", str(other))
    assert status == 2 and f"error: {other}: the draft's vocabulary" in err


@pytest.mark.parametrize("arch", ["gpt_oss", "switch_transformers"])
def test_self_draft_of_another_expert_kind(tiny_model, tmp_path, arch):
    """GPT-OSS's biased, clamped experts: the INT2 copy computes the target's kind, and greedy output
    equals plain greedy decoding; an encoder-decoder model is refused."""
    store = tmp_path / "store"
    convert(tiny_model(arch), store, bits=4)
    with edgemoe.load(store, compute="fused-float") as target:
        if arch == "switch_transformers":
            with pytest.raises(Exception, match="decoder-only"):
                Speculator(target, self_draft(target), 3, shares_cache=True)
            return
        ids = target.tokenizer.encode("Now is the winter")
        speculator = Speculator(target, self_draft(target), 3, shares_cache=True)
        assert list(speculator.stream(ids, _greedy(12))) == list(stream_tokens(target, ids, _greedy(12)))
        assert speculator.stats.accepted > 0
