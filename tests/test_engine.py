"""The continuous-batching engine without HTTP: batched output equals each request generated alone,
requests join mid-way and leave (cancel) between steps, stop strings and the context limit."""

import threading

import pytest

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.engine import Engine
from edgemoe.errors import ContextLengthError
from edgemoe.generate import GenerationOptions, generate_batch, stream_tokens

GREEDY = GenerationOptions(max_new_tokens=12, temperature=0.0, stop_token_ids=[])
PROMPTS = ["ROMEO:", "To be, or not to be, that is the question:", "JULIET:\nO"]


@pytest.fixture(scope="module")
def model():
    return edgemoe.load(bundled_model_path())


def run_until_idle(engine: Engine) -> int:
    steps = 0
    while engine.step():
        steps += 1
    return steps


def alone(model, prompt_ids, opts=GREEDY):
    return generate_batch(model, [prompt_ids], opts)[0]


def test_batched_requests_each_equal_their_generation_alone(model):
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    engine = Engine(model)
    requests = [engine.submit(p, GREEDY) for p in ids]
    model.timings.reset()
    steps = run_until_idle(engine)
    assert steps == GREEDY.max_new_tokens        # one shared step per token, prefills together in the first
    for request, prompt in zip(requests, ids):
        events = list(request.events())
        assert request.output_ids == alone(model, prompt)
        assert [t for e in events for t in e.token_ids] == request.output_ids
        assert "".join(e.text for e in events) == model.tokenizer.decode(request.output_ids)
        assert events[-1].finish_reason == "length" and request.usage.completion_tokens == 12


def test_a_request_joins_mid_way_in_the_same_steps_as_the_others(model):
    first, late = model.tokenizer.encode(PROMPTS[0]), model.tokenizer.encode(PROMPTS[1])
    engine = Engine(model)
    a = engine.submit(first, GREEDY)
    for _ in range(4):
        engine.step()
    model.timings.reset()
    b = engine.submit(late, GREEDY)
    run_until_idle(engine)
    assert model.timings.per_step[0][0] == len(late) + 1     # b's prefill shared a step with a's decode
    assert a.output_ids == alone(model, first) and b.output_ids == alone(model, late)


def test_a_cancelled_request_leaves_at_the_next_step_and_the_others_go_on(model):
    ids = [model.tokenizer.encode(p) for p in PROMPTS[:2]]
    engine = Engine(model)
    leaving, staying = (engine.submit(p, GREEDY) for p in ids)
    for _ in range(3):
        engine.step()
    leaving.cancel()
    model.timings.reset()
    engine.step()
    assert [tokens for tokens, _ in model.timings.per_step] == [1]   # only the staying request was fed
    assert engine.active == [staying] and len(leaving.output_ids) == 3
    assert [e.finish_reason for e in leaving.events()][-1] == "cancelled"
    run_until_idle(engine)
    assert staying.output_ids == alone(model, ids[1])


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    sampled = GenerationOptions(max_new_tokens=15, temperature=1.0, top_k=40, seed=5, stop_token_ids=[])
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    engine = Engine(model)
    requests = [engine.submit(p, sampled) for p in ids]
    run_until_idle(engine)
    for request, prompt in zip(requests, ids):
        assert request.output_ids == list(stream_tokens(model, prompt, sampled))


def test_stop_strings_and_stop_tokens_as_generate_does(model):
    full = model.generate("ROMEO:", max_new_tokens=20, temperature=0.0, stop_token_ids=[])
    stop = full[6:9]
    engine = Engine(model)
    by_string = engine.submit(model.tokenizer.encode("ROMEO:"),
                              GenerationOptions(max_new_tokens=20, temperature=0.0, stop_token_ids=[],
                                                stop_strings=[stop]))
    free = alone(model, model.tokenizer.encode("ROMEO:"))
    by_token = engine.submit(model.tokenizer.encode("ROMEO:"),
                             GenerationOptions(max_new_tokens=20, temperature=0.0, stop_token_ids=[free[3]]))
    run_until_idle(engine)
    events = list(by_string.events())
    assert "".join(e.text for e in events) == full[:full.index(stop)] and events[-1].finish_reason == "stop"
    assert by_token.output_ids == free[:free.index(free[3])]
    assert list(by_token.events())[-1].finish_reason == "stop"


def test_generation_stops_at_the_context_limit_and_a_full_prompt_is_refused(model):
    context = model.spec.max_position_embeddings
    engine = Engine(model)
    with pytest.raises(ContextLengthError, match="max_position_embeddings"):
        engine.submit([5] * context, GREEDY)
    near_full = engine.submit([5] * (context - 4), GenerationOptions(max_new_tokens=50, temperature=0.0,
                                                                     stop_token_ids=[]))
    run_until_idle(engine)
    assert len(near_full.output_ids) == 4 and near_full.finish_reason == "length"


def test_engine_thread_serves_submissions_and_close_cancels_the_rest(model):
    engine = Engine(model, max_batch=1).start()
    try:
        done = engine.submit(model.tokenizer.encode("ROMEO:"), GREEDY)
        assert [e.finish_reason for e in done.events()][-1] == "length"
        assert done.output_ids == alone(model, model.tokenizer.encode("ROMEO:"))
    finally:
        long = engine.submit(model.tokenizer.encode("ROMEO:"), GenerationOptions(max_new_tokens=200))
        waiting = engine.submit(model.tokenizer.encode("JULIET:"), GREEDY)   # max_batch=1: still queued
        engine.close()
    assert long.finish_reason in ("cancelled", "stop", "length")
    assert waiting.finish_reason == "cancelled" and [e.finish_reason for e in waiting.events()][-1] == "cancelled"


def test_run_steps_on_the_calling_thread_until_stop_leaving_the_rest_to_close(model):
    engine = Engine(model, max_batch=1)
    done = engine.submit(model.tokenizer.encode("ROMEO:"), GREEDY)
    waiting = engine.submit(model.tokenizer.encode("JULIET:"), GREEDY)   # max_batch=1: after the first
    stepped_on = set()
    step = engine.step
    engine.step = lambda: (stepped_on.add(threading.get_ident()), step())[1]

    def stop_after_the_first() -> None:
        list(done.events())
        engine.stop()

    stopper = threading.Thread(target=stop_after_the_first)
    stopper.start()
    engine.run()                       # returns once stop() is called
    stopper.join()
    assert stepped_on == {threading.get_ident()}
    assert done.output_ids == alone(model, model.tokenizer.encode("ROMEO:")) and done.finish_reason == "length"
    engine.close()                     # ends what stop() left: the second request, unless it finished
    assert waiting.finish_reason in ("cancelled", "length")


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(model, monkeypatch):
    engine = Engine(model)
    failing = engine.submit(model.tokenizer.encode("ROMEO:"), GREEDY)
    def broken(*args, **kwargs):
        raise OSError("expert file unreadable")

    monkeypatch.setattr(model, "forward", broken)
    engine.step()
    monkeypatch.undo()
    event = list(failing.events())[-1]
    assert event.finish_reason == "error" and "expert file unreadable" in event.error and engine.active == []
    later = engine.submit(model.tokenizer.encode("ROMEO:"), GREEDY)
    run_until_idle(engine)
    assert later.output_ids == alone(model, model.tokenizer.encode("ROMEO:"))
