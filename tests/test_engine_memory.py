"""Serving's admission by memory (edgemoe.engine.MemoryAdmission): a request joins the active ones only
if what it will take next fits in what the process may still take, read from a fake /proc tree; one
that does not waits, then runs with the output it has alone; where the active ones' growth no longer
fits, the last to join is paused and later resumes with the output it would have had alone."""

import math
from pathlib import Path

import pytest
import torch

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.convert import convert
from edgemoe import engine as engine_module
from edgemoe.engine import Engine, MemoryAdmission
from edgemoe.generate import Generation, GenerationOptions, generate_batch, step
from edgemoe.kernels.ops import INT_PATH_ENV, int_paths
from edgemoe.kv_cache import KVCache
from edgemoe.loader import kv_cache_bytes, step_row_bytes
from edgemoe.store.memory import GROWN_MARGIN_FIXED, GROWN_MARGIN_SHARE

GREEDY = GenerationOptions(max_new_tokens=40, temperature=0.0, stop_token_ids=[])


@pytest.fixture(scope="module")
def model():
    return edgemoe.load(bundled_model_path())


def meminfo_root(root: Path, available: int) -> Path:
    """A fake file system root whose /proc/meminfo says `available` bytes (no cgroup)."""
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    return root


def run_until_idle(engine: Engine) -> None:
    while engine.step():
        pass


def cache_bytes(cache: KVCache) -> int:
    return sum(t.nbytes for t in cache._k + cache._v)


def test_need_covers_the_kv_cache_a_generation_allocates_and_future_is_its_growth(model):
    ids = model.tokenizer.encode("ROMEO:")
    generation = Generation(model, ids, GREEDY)
    admission = MemoryAdmission(model)
    need = admission.need(generation)
    assert admission.future(generation) == need                  # nothing allocated yet
    step(model, [generation])
    cache = generation.feed.state
    final = len(ids) + GREEDY.max_new_tokens
    assert admission.future(generation) == cache.growth_to(final)
    while not generation.finished:
        last = generation.feed.state
        step(model, [generation])
    assert cache_bytes(last) <= need and last.length == final - 1   # the last token is sampled, not cached


def test_the_final_length_stops_at_the_context(model):
    context = model.context_length
    generation = Generation(model, [5] * (context - 3), GenerationOptions(max_new_tokens=50))
    assert MemoryAdmission.final_length(generation) == context


def test_room_is_what_is_available_less_the_active_requests_growth_and_the_margin(model, tmp_path):
    available = 4 << 30
    admission = MemoryAdmission(model, meminfo_root(tmp_path, available))
    active = [Generation(model, model.tokenizer.encode(p), GREEDY) for p in ("ROMEO:", "JULIET:")]
    margin = GROWN_MARGIN_FIXED + int(GROWN_MARGIN_SHARE * available)
    assert admission.room(active) == available - margin - sum(admission.need(g) for g in active)
    assert MemoryAdmission(model, tmp_path / "nothing").room(active) is None   # memory unknown


def _available_for(need: int) -> int:
    """The fewest bytes (whole KiB, as /proc/meminfo counts) whose room, margin taken, is `need`."""
    return 1024 * math.ceil((need + GROWN_MARGIN_FIXED) / (1 - GROWN_MARGIN_SHARE) / 1024 + 1)


def _two_requests(model, root):
    engine = Engine(model, memory_root=root)
    prompts = [model.tokenizer.encode(p) for p in ("ROMEO:", "To be, or not to be")]
    return engine, prompts, [engine.submit(p, GREEDY) for p in prompts]


def test_a_request_that_fits_joins_the_first_one(model, tmp_path):
    probe, prompts, _ = _two_requests(model, tmp_path)
    needs = [probe.memory.need(Generation(model, p, GREEDY)) for p in prompts]
    engine, _, requests = _two_requests(model, meminfo_root(tmp_path, _available_for(sum(needs))))
    engine.step()
    assert engine.active == requests
    run_until_idle(engine)
    for request, prompt in zip(requests, prompts):
        assert request.output_ids == generate_batch(model, [prompt], GREEDY)[0]


def test_a_request_that_does_not_fit_waits_for_the_first_then_runs_as_alone(model, tmp_path, caplog):
    """The fake memory shrinks by what the first request's KV cache holds, as a real one would."""
    prompts = [model.tokenizer.encode(p) for p in ("ROMEO:", "To be, or not to be")]
    probe = Generation(model, prompts[0], GREEDY)
    step(model, [probe])
    first_takes = cache_bytes(probe.feed.state) + probe.feed.state.growth_to(MemoryAdmission.final_length(probe))
    second_needs = MemoryAdmission(model).need(Generation(model, prompts[1], GREEDY))
    base = _available_for(first_takes + second_needs) - 8192
    root = meminfo_root(tmp_path, base)
    engine = Engine(model, memory_root=root)
    first, second = (engine.submit(p, GREEDY) for p in prompts)
    with caplog.at_level("INFO", logger="edgemoe.engine"):
        while first.finish_reason is None:
            engine.step()
            assert engine.active in ([first], []) and second.output_ids == []
            state = first.generation.feed.state if first.generation.feed is not None else None
            meminfo_root(tmp_path, base - (cache_bytes(state) if state is not None else 0))
    assert len([r for r in caplog.records if "waits for memory" in r.getMessage()]) == 1   # said once
    engine.step()
    assert engine.active == [second]
    run_until_idle(engine)
    assert first.output_ids == generate_batch(model, [prompts[0]], GREEDY)[0]
    assert second.output_ids == generate_batch(model, [prompts[1]], GREEDY)[0]


def test_a_request_without_a_near_limit_is_counted_a_horizon_past_where_it_is(model, monkeypatch):
    """One that may run to the context (a served request without max_tokens) is counted
    ADMISSION_HORIZON tokens ahead, and its count moves on with its output."""
    monkeypatch.setattr(engine_module, "ADMISSION_HORIZON", 16)
    ids = model.tokenizer.encode("ROMEO:")
    unbounded = Generation(model, ids, GenerationOptions(max_new_tokens=model.context_length, stop_token_ids=[]))
    admission = MemoryAdmission(model)
    assert MemoryAdmission.final_length(unbounded) == model.context_length
    assert MemoryAdmission.committed_length(unbounded) == len(ids) + 16
    assert admission.need(unbounded) == (kv_cache_bytes(model.spec, len(ids) + 16, model.kv_dtype, model.context_length)
                                         + step_row_bytes(model.spec, 1))
    for _ in range(5):
        step(model, [unbounded])
    assert MemoryAdmission.committed_length(unbounded) == len(ids) + 5 + 16
    assert admission.future(unbounded) == unbounded.feed.state.growth_to(len(ids) + 5 + 16)
    near = Generation(model, ids, GenerationOptions(max_new_tokens=4))
    assert MemoryAdmission.committed_length(near) == len(ids) + 4


def _solo_events(model, prompt, opts):
    generation = Generation(model, prompt, opts, text=True)
    events = []
    while not generation.finished:
        events += [e for e in step(model, [generation]) if e is not None]
    return events


def _pause_and_resume(model, tmp_path, caplog, opts) -> None:
    """Two requests decode side by side; the memory read falls below what their growth takes: the
    second is paused (its cache dropped, back in the queue, no event), the first goes on; once room
    is made the second recomputes its cache and goes on. Each one's events are those it has alone."""
    prompts = [model.tokenizer.encode(p) for p in ("ROMEO:", "To be, or not to be")]
    root = meminfo_root(tmp_path, 4 << 30)
    engine = Engine(model, memory_root=root)
    first, second = (engine.submit(p, opts) for p in prompts)
    for _ in range(6):
        engine.step()
    assert engine.active == [first, second] and len(second.output_ids) == 6   # a token a step
    meminfo_root(tmp_path, 0)
    with caplog.at_level("INFO", logger="edgemoe.engine"):
        for _ in range(8):
            engine.step()
            assert engine.active == [first] and second.generation.feed is None and len(second.output_ids) == 6
    assert [r.getMessage() for r in caplog.records if "paused" in r.getMessage()] == [
        "request 1 paused for memory after 6 tokens (1 active left): it resumes, recomputing its KV cache, "
        "when room is made"]
    meminfo_root(tmp_path, 4 << 30)
    run_until_idle(engine)
    for request, prompt in zip((first, second), prompts):
        events = list(request.events())
        alone = _solo_events(model, prompt, opts)
        assert [e.token_ids for e in events] == [e.token_ids for e in alone]
        assert "".join(e.text for e in events) == "".join(e.text for e in alone)
        assert events[-1].finish_reason == "length"


@pytest.mark.parametrize("dtype, sampled", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_the_last_to_join_is_paused_when_growth_does_not_fit_and_resumes_as_if_alone(tmp_path, caplog, dtype, sampled):
    opts = (GenerationOptions(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=7, stop_token_ids=[])
            if sampled else GenerationOptions(max_new_tokens=30, temperature=0.0, stop_token_ids=[]))
    _pause_and_resume(edgemoe.load(bundled_model_path(), dtype), tmp_path, caplog, opts)


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paused_request_of_a_store_resumes_from_its_prompt_and_output_on_every_integer_path(
        bundled_int4_store, tmp_path, monkeypatch, path, dtype):
    """On an INT4 store as the commands load it (the decode engine, integer expert kernels), on every
    integer path this CPU runs, in either dense dtype: the paused request waits until the first ends,
    then goes on as a request whose prompt is its prompt and the tokens it had, fed as a prompt is,
    with no token lost or sent twice. (Its tokens before the pause, decoded beside the first's, are
    not compared with a run alone: a step of several tokens rounds its attention in other last bits
    than the one-token decode engine.)"""
    monkeypatch.setenv(INT_PATH_ENV, path)
    opts = GenerationOptions(max_new_tokens=30, temperature=0.0, stop_token_ids=[])
    with edgemoe.load(bundled_int4_store, dtype, dense_bits="auto") as model:
        prompts = [model.tokenizer.encode(p) for p in ("ROMEO:", "To be, or not to be")]
        engine = Engine(model, memory_root=meminfo_root(tmp_path, 4 << 30))
        first, second = (engine.submit(p, opts) for p in prompts)
        for _ in range(6):
            engine.step()
        meminfo_root(tmp_path, 0)
        while first.finish_reason is None:
            engine.step()
            assert second.generation.feed is None and len(second.output_ids) == 6
        had = list(second.output_ids)
        run_until_idle(engine)
        events = list(second.events())
        assert [t for e in events for t in e.token_ids] == second.output_ids and len(second.output_ids) == 30
        rest = GenerationOptions(max_new_tokens=30 - len(had), temperature=0.0, stop_token_ids=[])
        assert second.output_ids == had + generate_batch(model, [prompts[1] + had], rest)[0]


def test_pausing_stops_at_the_first_request_and_makes_the_room_it_counts(model, tmp_path):
    """With no room at all every request but the first is paused, the last to join first; each
    pause adds its cache and its growth to the room; unknown memory pauses none."""
    root = meminfo_root(tmp_path, 4 << 30)
    engine = Engine(model, memory_root=root)
    requests = [engine.submit(model.tokenizer.encode(p), GREEDY) for p in ("ROMEO:", "JULIET:", "To be")]
    for _ in range(3):
        engine.step()
    assert engine.active == requests
    released = [engine.memory.released_by_pausing(r.generation) for r in requests]
    cache = requests[2].generation.feed.state
    assert released[2] == cache.nbytes + cache.growth_to(MemoryAdmission.committed_length(requests[2].generation))
    room = engine.memory.room([r.generation for r in requests])
    engine.step()                           # the same memory: room stays >= 0, nobody is paused
    assert engine.active == requests
    meminfo_root(tmp_path, 0)
    engine.step()
    assert engine.active == requests[:1] and list(engine._held) == requests[1:]
    assert room > 0 and all(r.generation.feed is None for r in requests[1:])
    unknown = Engine(model, memory_root=tmp_path / "unknown")
    spared = [unknown.submit(model.tokenizer.encode(p), GREEDY) for p in ("ROMEO:", "JULIET:")]
    for _ in range(3):
        unknown.step()
    assert unknown.active == spared


def test_the_first_request_runs_even_without_room_and_unknown_memory_admits_all(model, tmp_path):
    engine, _, requests = _two_requests(model, meminfo_root(tmp_path / "tight", 0))
    engine.step()
    assert engine.active == requests[:1]
    engine, _, requests = _two_requests(model, tmp_path / "unknown")
    engine.step()
    assert engine.active == requests


def test_a_request_waiting_for_memory_can_be_cancelled_and_close_ends_the_waiting(model, tmp_path):
    engine, _, (first, second) = _two_requests(model, meminfo_root(tmp_path, 0))
    engine.step()
    second.cancel()
    engine.step()
    assert [e.finish_reason for e in second.events()] == ["cancelled"] and engine.active == [first]
    third = engine.submit(model.tokenizer.encode("JULIET:"), GREEDY)
    engine.step()
    engine.close()
    assert third.finish_reason == "cancelled" and first.finish_reason == "cancelled"


def test_the_ram_tier_not_yet_filled_counts_against_the_room(tmp_path):
    store = tmp_path / "store"
    convert(bundled_model_path(), store, bits=4)
    served = edgemoe.load(store, ram="50%")
    try:
        admission = MemoryAdmission(served, meminfo_root(tmp_path / "root", 4 << 30))
        cached, capacity = served.store.ram_filled()
        assert capacity - cached > 0
        assert admission.room([]) == (4 << 30) - GROWN_MARGIN_FIXED - int(GROWN_MARGIN_SHARE * (4 << 30)) - (
            capacity - cached)
    finally:
        served.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_feeds_prompt_chunks_up_to_its_budget_and_every_decoding_token(dtype):
    """Greedy outputs identical to each prompt alone, in either compute dtype."""
    model = edgemoe.load(bundled_model_path(), dtype)
    chunked = GenerationOptions(max_new_tokens=6, temperature=0.0, stop_token_ids=[], prefill_chunk=8)
    text = model.tokenizer.encode("To be, or not to be, that is the question: whether 'tis nobler in the "
                                  "mind to suffer the slings and arrows of outrageous fortune")
    prompts = [text[:20], text[3:22]]
    engine = Engine(model, step_prompt_tokens=12)
    requests = [engine.submit(p, chunked) for p in prompts]
    model.timings.reset()
    run_until_idle(engine)
    fed = [tokens for tokens, _ in model.timings.per_step]
    # the first prompt's chunks of 8, one a step (two would pass 12), then its last 4 beside the
    # second's first 8; then its decoding tokens ride along with the second prompt's chunks
    assert fed[:5] == [8, 8, 4 + 8, 1 + 8, 1 + 3] and set(fed[5:]) <= {1, 2}
    assert sum(fed) == sum(map(len, prompts)) + 2 * (chunked.max_new_tokens - 1)
    for request, prompt in zip(requests, prompts):
        assert request.output_ids == generate_batch(model, [prompt], chunked)[0]


def test_a_chunk_larger_than_the_budget_still_goes_first_and_decoding_never_waits(model):
    chunked = GenerationOptions(max_new_tokens=4, temperature=0.0, stop_token_ids=[], prefill_chunk=8)
    text = model.tokenizer.encode("To be, or not to be, that is the question: whether 'tis nobler in the "
                                  "mind to suffer the slings and arrows of outrageous fortune")
    engine = Engine(model, step_prompt_tokens=4)
    early = engine.submit(text[:5], chunked)
    engine.step()                                   # its prompt fed: decoding from now on
    late = engine.submit(text[:16], chunked)
    model.timings.reset()
    for _ in range(20):                             # bounded: a chunk that never fits would loop forever
        if not engine.step():
            break
    assert late.finish_reason == "length"
    assert [tokens for tokens, _ in model.timings.per_step][:2] == [1 + 8, 1 + 8]
    assert early.output_ids == generate_batch(model, [text[:5]], chunked)[0]
    assert late.output_ids == generate_batch(model, [text[:16]], chunked)[0]


def test_a_step_budget_below_one_token_is_refused(model):
    with pytest.raises(ValueError, match="step_prompt_tokens"):
        Engine(model, step_prompt_tokens=0)
