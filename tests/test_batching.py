"""Several sequences in one step give each the same logits as running it alone, in prefill and decode;
the expert path groups tokens by expert."""

import torch

import edgemoe
from edgemoe.experts import ExpertBatches
from edgemoe.generate import GenerationOptions, generate_batch
from edgemoe.model import Segment

TOL = 1e-5


def test_expert_batches_group_every_token_expert_pair_once():
    experts = torch.tensor([[2, 0], [0, 3], [2, 3], [1, 0]])        # [T=4, A=2]
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    batches = ExpertBatches.from_routing(weights, experts)
    assert batches.experts == [0, 1, 2, 3]
    assert [t.tolist() for t in batches.tokens] == [[0, 1, 3], [3], [0, 2], [1, 2]]
    assert [w.tolist() for w in batches.weights] == [
        [0.4000000059604645, 0.699999988079071, 0.10000000149011612], [0.8999999761581421],
        [0.6000000238418579, 0.5], [0.30000001192092896, 0.5]]


def test_one_token_batches_are_those_of_the_general_grouping():
    for row, weights in (([5, 1, 3], [0.5, 0.3, 0.2]), ([0, 7], [0.6, 0.4]), ([4, 4], [0.5, 0.5])):
        experts, w = torch.tensor([row]), torch.tensor([weights])
        fast, general = ExpertBatches.from_routing(w, experts), ExpertBatches._sorted(w, experts)
        assert fast.experts == general.experts == sorted(set(row))
        assert [t.tolist() for t in fast.tokens] == [t.tolist() for t in general.tokens]
        assert [x.tolist() for x in fast.weights] == [x.tolist() for x in general.weights]


def test_sequences_of_different_lengths_batched_in_prefill_and_decode(tiny_model):
    model = edgemoe.load(tiny_model("qwen2_moe", sliding_window=4, use_sliding_window=True, max_window_layers=2))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.spec.vocab_size, (n,), generator=g) for n in (7, 2, 11)]
    follow_ups = [torch.randint(3, model.spec.vocab_size, (3,), generator=g) for _ in prompts]

    alone = []
    for prompt, more in zip(prompts, follow_ups):
        cache = model.new_cache()
        alone.append(torch.cat([model.logits(prompt, cache)] + [model.logits(more[i:i + 1], cache) for i in range(3)]))

    caches = [model.new_cache() for _ in prompts]
    prefill = model.forward(torch.cat(prompts), [Segment(c, len(p)) for c, p in zip(caches, prompts)])
    together = list(torch.split(prefill, [len(p) for p in prompts]))
    for step in range(3):
        logits = model.forward(torch.stack([m[step] for m in follow_ups]), [Segment(c, 1) for c in caches])
        together = [torch.cat([t, logits[i:i + 1]]) for i, t in enumerate(together)]
    for a, b in zip(alone, together):
        assert (a - b).abs().max() <= TOL


def test_last_only_returns_each_segments_last_token(tiny_model):
    model = edgemoe.load(tiny_model("mixtral"))
    a, b = torch.tensor([5, 6, 7]), torch.tensor([8, 9])
    full = model.forward(torch.cat([a, b]), [Segment(model.new_cache(), 3), Segment(model.new_cache(), 2)])
    last = model.forward(torch.cat([a, b]), [Segment(model.new_cache(), 3), Segment(model.new_cache(), 2)],
                         last_only=True)
    assert (last - full[[2, 4]]).abs().max() <= TOL


def test_generate_batch_equals_one_prompt_at_a_time(tiny_model):
    model = edgemoe.load(tiny_model("olmoe"))
    prompts = [model.tokenizer.encode(t) for t in ("All the world", "To be, or not to be, that is", "Now")]
    opts = GenerationOptions(max_new_tokens=12, stop_token_ids=[])
    together = generate_batch(model, prompts, opts)
    assert together == [generate_batch(model, [p], opts)[0] for p in prompts]
    assert all(len(t) == 12 for t in together)


def test_cache_fork_and_truncate(tiny_model):
    model = edgemoe.load(tiny_model("mixtral"))
    tokens = torch.tensor([4, 9, 13, 21, 30])
    cache = model.new_cache()
    model.logits(tokens[:3], cache)
    twin = cache.fork()
    expected = model.logits(tokens[3:], cache)
    assert (model.logits(tokens[3:], twin) - expected).abs().max() <= TOL
    cache.truncate(3)                                      # drop two tokens, as a rejected draft would
    assert (model.logits(tokens[3:], cache) - expected).abs().max() <= TOL


def test_chunked_prefill_gives_the_same_text_and_reads_each_expert_once_per_chunk(tiny_model, tmp_path):
    from edgemoe.generate import stream_tokens
    from edgemoe.convert import convert

    convert(tiny_model("mixtral"), tmp_path / "s", bits=8)
    model = edgemoe.load(tmp_path / "s", preload="none", compute="fused-float")   # one path for every chunk size
    prompt = model.tokenizer.encode("All the world's a stage, and all the men and women merely players; " * 3)
    whole = GenerationOptions(max_new_tokens=6, stop_token_ids=[], prefill_chunk=10_000)
    chunked = GenerationOptions(max_new_tokens=6, stop_token_ids=[], prefill_chunk=16)
    assert generate_batch(model, [prompt, prompt[:20]], chunked) == generate_batch(model, [prompt, prompt[:20]], whole)
    store = model.store
    before = store.stats.requests
    model.timings.reset()
    assert list(stream_tokens(model, prompt, chunked)) == generate_batch(model, [prompt], whole)[0]
    chunks = -(-len(prompt) // 16)
    prefill_steps = model.timings.per_step[:chunks]
    assert [n for n, _ in prefill_steps] == [16] * (chunks - 1) + [len(prompt) - 16 * (chunks - 1)]
    layers, experts = model.spec.num_layers, model.spec.num_experts
    assert store.stats.requests - before <= (chunks + 6) * layers * experts   # at most once per step
