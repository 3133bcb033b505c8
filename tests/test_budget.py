"""The bit-width budget search: its logic on a tiny model, the exactness of the layer-input cache,
and the store it writes."""


import pytest
import torch

import edgemoe
from edgemoe.convert import QualityBudget, convert
from edgemoe.convert.budget import WIDTHS, BudgetSearch, Calibration, parse_budget
from edgemoe.store import read_manifest

TEXT = ("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. "
        "The evil that men do lives after them; the good is oft interred with their bones. ") * 3


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    return tiny_model("mixtral", num_hidden_layers=3, num_local_experts=4)


@pytest.fixture(scope="module")
def search(checkpoint):
    model = edgemoe.load(checkpoint)
    ids = torch.tensor(model.tokenizer.encode(TEXT, add_special_tokens=False))
    # KL, not perplexity: a random model predicts nearly uniformly, so its perplexity barely moves
    # under quantization, while the KL to the unquantized model grows with every bit taken away.
    return BudgetSearch(model, Calibration(model, ids, context=48, metric="kl"))


def uniform_losses(search):
    """The loss estimate of every uniform width (run() measures only those up to the ceiling)."""
    return {bits: search.uniform(bits)[0] for bits in WIDTHS}


def assert_rerun_from_layer_is_exact(search, keys):
    """Each key at INT2 among INT4: the loss re-run from its layer on cached inputs equals the full run."""
    base = {key: 4 for key in search.keys}
    search._cache_layer_inputs(base)
    for key in keys:
        partial = search.loss({**base, key: 2}, start_layer=key[0])
        full = search.loss({**base, key: 2}, start_layer=0)
        assert partial == pytest.approx(full, rel=1e-6, abs=1e-9)


@pytest.fixture(scope="module")
def eight_experts(tiny_model):
    """(model, calibration) of a 3-layer mixtral with 8 experts per layer: 24 to rank."""
    model = edgemoe.load(tiny_model("mixtral", num_hidden_layers=3, num_local_experts=8))
    ids = torch.tensor(model.tokenizer.encode(TEXT * 4, add_special_tokens=False))
    return model, Calibration(model, ids, context=48, metric="kl")


def test_local_importance_ranks_experts_as_the_exact_one_does(eight_experts):
    """The default estimate (local error x layer sensitivity) orders the experts as the exact one
    (one re-run per expert) does, at the cost of one re-run per layer instead of one per expert."""
    from scipy.stats import spearmanr

    model, calibration = eight_experts
    ranking, _ = calibration.halves()
    scores, evaluations = {}, {}
    for method in ("exact", "local"):
        search = BudgetSearch(model, calibration, importance=method)
        scores[method] = search.importance(2, 4, ranking)
        evaluations[method] = search.evaluations
    keys = sorted(scores["exact"])
    assert spearmanr([scores["exact"][k] for k in keys], [scores["local"][k] for k in keys]).statistic > 0.9
    assert evaluations == {"exact": 1 + len(keys), "local": 1 + model.spec.num_layers}


def test_local_error_is_the_routing_weighted_output_error_on_routed_tokens(eight_experts):
    """LocalErrors' figure for each expert, recomputed from the layer's MoE input and routing: the
    squared norm of w * (expert at the floor - expert at the ceiling) over the tokens routed to it."""
    from edgemoe.convert.budget import LocalErrors

    model, calibration = eight_experts
    search = BudgetSearch(model, calibration)
    search.experts.widths = {key: 4 for key in search.keys}
    twin = search._quantized
    seen = {}
    twin.moe_input_hooks.append(lambda l, x: seen.__setitem__(l, x))
    twin.routing_hooks.append(lambda l, experts, weights, *_: seen.__setitem__((l, "routing"), (experts, weights)))
    probe = LocalErrors(search.experts, floor=2)
    twin.experts = probe
    twin.logits(calibration.windows[0])
    layer = 1
    x, (experts, weights) = seen[layer], seen[layer, "routing"]
    for e in range(model.spec.num_experts):
        rows, slots = (experts == e).nonzero(as_tuple=True)
        w = weights[rows, slots][:, None]
        xs = x[rows]
        expected = (w * (search.experts.at((layer, e), 2)(xs) - search.experts.at((layer, e), 4)(xs))).square().sum()
        assert probe.errors.get((layer, e), 0.0) == pytest.approx(expected.item(), rel=1e-5)
    assert sum(1 for l, _ in probe.errors if l == layer) == len(set(experts.reshape(-1).tolist()))


@pytest.mark.parametrize("method", ["local", "exact"])
def test_either_importance_keeps_the_chosen_mix_within_budget(eight_experts, method):
    model, calibration = eight_experts
    search = BudgetSearch(model, calibration, importance=method)
    uniform = uniform_losses(search)
    budget = (uniform[2] + uniform[4]) / 2
    result = search.run(budget)
    assert result.importance_method == method and result.to_json()["importance_method"] == method
    assert (result.floor, result.ceiling) == (2, 4) and 0 < result.moved_down < len(search.keys)
    assert result.loss_bound <= budget
    assert bool(result.layer_loss) == (method == "local")


def test_local_importance_reports_progress_in_layers_computed(eight_experts):
    """A re-run from layer l computes layers l.. only: progress counts those, so that the bar's rate,
    and the time left it shows, hold from the first layer to the last."""
    model, calibration = eight_experts
    reports = []
    search = BudgetSearch(model, calibration, progress=lambda stage, done, total: reports.append((stage, done, total)))
    search.importance(2, 4, calibration.halves()[0])
    assert [(done, total) for stage, done, total in reports if stage == "importance"] == [(3, 6), (5, 6), (6, 6)]


def test_the_chosen_mix_holds_on_the_whole_calibration_text(eight_experts, monkeypatch):
    """K is chosen on half the windows; the mix recorded must be within the budget on all of them:
    given a choice that is not (every expert at the floor), the search moves experts back up."""
    search = BudgetSearch(*eight_experts, importance="exact")
    budget = a_budget_between_int2_and_int4(search)
    monkeypatch.setattr(search, "_largest_k", lambda order, *args, **kwargs: len(order))
    result = search.run(budget)
    assert 0 < result.moved_down < len(search.keys) and result.loss_bound <= budget


def test_the_count_moved_back_is_searched_not_walked(eight_experts, monkeypatch):
    """Where the mix chosen on half the windows does not hold on all, the count at the floor is
    searched down from K (gallop, then bisect): the same count a walk of one expert at a time finds
    when the loss grows with the count, in about 2 log2(K - answer) evaluations, not K - answer."""
    import math

    search = BudgetSearch(*eight_experts, importance="exact")
    order = sorted(search.keys)
    counts = []

    def loss_of_count(widths, start_layer=0, windows=None):
        down = sum(bits == 2 for bits in widths.values())
        counts.append(down)
        return float(down), float(down) + 0.25

    monkeypatch.setattr(search, "loss", loss_of_count)
    for holds_up_to in range(len(order) + 1):
        budget = holds_up_to + 0.5
        for k in range(holds_up_to, len(order) + 1):
            counts.clear()
            widths, count, loss, bound = search._holding_on_all_windows(order, k, 2, 4, budget)
            assert count == holds_up_to and bound <= budget and loss == count
            assert widths == {key: 2 if i < count else 4 for i, key in enumerate(order)}
            assert len(counts) <= 2 + 2 * math.ceil(math.log2(k - count + 1))


def count_search_on(search, monkeypatch, costs):
    """search's loss replaced by the sum of `costs` (one per key of sorted(search.keys)) over the
    experts at the floor; the uniform ends kept, as run() finds them. -> the counts evaluated."""
    order, evaluated, kept = sorted(search.keys), [], {}

    def fake_loss(widths, start_layer=0, windows=None):
        down = [key for key in order if widths[key] == 2]
        assert down == order[:len(down)]       # the count search moves a prefix of its order down
        evaluated.append(len(down))
        kept[len(down)] = sum(costs[:len(down)])
        return kept[len(down)], kept[len(down)]

    def fake_kept(widths, windows):
        count = sum(bits == 2 for bits in widths.values())
        return (kept[count], kept[count]) if count in kept else None

    monkeypatch.setattr(search, "loss", fake_loss)
    monkeypatch.setattr(search, "_kept_loss", fake_kept)
    for count in (0, len(order)):
        kept[count] = sum(costs[:count])
    return order, evaluated


@pytest.mark.parametrize("prediction", ["true", "noisy", "reversed", "none"])
def test_the_count_search_finds_a_binary_searchs_answer(eight_experts, monkeypatch, prediction):
    """The count at the floor is searched by interpolating the ranking's summed importance between
    measured counts: the answer is a binary search's (the largest count within the budget, the loss
    growing with the count) whatever the prediction's quality; a true prediction takes 2
    evaluations, a false one at most about three times a binary search's."""
    import math
    import random

    search = BudgetSearch(*eight_experts)
    rng = random.Random(0)
    costs = [rng.uniform(0.1, 2.0) for _ in search.keys]
    scores_of = {"true": costs, "noisy": [c * rng.uniform(0.5, 2.0) for c in costs],
                 "reversed": costs[::-1], "none": None}[prediction]
    for answer in range(len(costs)):
        budget = sum(costs[:answer]) + costs[answer] / 2
        search._counts_tried = set()
        order, evaluated = count_search_on(search, monkeypatch, costs)
        scores = None if scores_of is None else dict(zip(order, scores_of))
        assert search._largest_k(order, 2, 4, budget, [0], scores=scores) == answer
        if prediction == "true":
            assert len(evaluated) <= 2
        assert len(evaluated) <= 3 * math.ceil(math.log2(len(order) + 1))



def test_interpolated_count_predicts_between_measured_counts():
    from edgemoe.convert.budget import interpolated_count

    position = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # Bound 0 at count 0, 6 at count 6, linear in position: budget 3.5 predicts count 3.
    assert interpolated_count(position, 3.5, 0, 5, {0: 0.0, 6: 6.0}) == 3
    assert interpolated_count(position, 3.5, 0, 5, {0: 0.0}) is None      # no measured count over it
    assert interpolated_count(position, 3.5, 0, 5, {6: 6.0}) is None      # none within it
    assert interpolated_count(position, 3.5, 0, 5, {0: 1.0, 6: 0.5}) is None       # no rise
    assert interpolated_count(position, 0.1, 2, 5, {0: 0.0, 6: 6.0}) == 3  # into (lo, hi]
    assert interpolated_count(position, 5.9, 0, 4, {0: 0.0, 6: 6.0}) == 4


def test_uniform_widths_are_measured_narrowest_first_up_to_the_ceiling(eight_experts):
    """The uniform stores above the ceiling are not needed: INT2 within the budget costs one pass."""
    search = BudgetSearch(*eight_experts)
    bounds = {bits: search.uniform(bits)[1] for bits in WIDTHS}
    for budget, measured in ((bounds[2], [2]), ((bounds[2] + bounds[4]) / 2, [2, 4]), (0.0, [2, 4, 8])):
        fresh = BudgetSearch(*eight_experts)
        result = fresh.run(budget)
        assert list(result.uniform_loss) == measured and result.ceiling == (measured[-1] if budget else 8)
        if measured == [2]:
            assert fresh.evaluations == 1 and set(result.widths.values()) == {2}


def test_a_windows_loss_under_given_widths_is_computed_once(eight_experts):
    """loss() keeps each window's loss per widths: asked again, nothing runs; asked for more
    windows, only the new ones run; the figures are those of a search that never saw them."""
    model, calibration = eight_experts
    search = BudgetSearch(model, calibration)
    mix = {key: (2, 4, 8)[(key[0] + key[1]) % 3] for key in search.keys}
    ranking, choosing = calibration.halves()
    search.loss(mix, windows=ranking)
    whole = search.loss(mix)
    assert search.evaluations == 2 and search.loss(mix) == whole and search.evaluations == 2
    passes = []
    search._pass = lambda windows, *args: passes.append(list(windows))
    search.loss(mix, windows=choosing)
    assert passes == []
    assert BudgetSearch(model, calibration).loss(mix) == whole


def test_the_layer_inputs_are_cached_once_for_importance_and_boundary(eight_experts, monkeypatch):
    """The local probe's pass records the layer inputs; the boundary's exact re-runs reuse them."""
    search = BudgetSearch(*eight_experts)
    budget = a_budget_between_int2_and_int4(search)
    recorded = []
    run_pass = search._pass
    monkeypatch.setattr(search, "_pass", lambda windows, start_layer=0, record_inputs=False: (
        recorded.append(record_inputs), run_pass(windows, start_layer, record_inputs)))
    result = search.run(budget)
    assert result.boundary and recorded.count(True) == 1


def test_sensitivity_is_measured_per_group_of_layers(eight_experts):
    """With fewer groups than layers, one re-run per group of consecutive layers: each expert's score
    is its local error times its group's loss change over the group's summed local error, so a
    group's scores add up to its measured loss change; one group per layer is the per-layer method."""
    from edgemoe.convert.budget import LocalErrors

    model, calibration = eight_experts
    ranking, _ = calibration.halves()
    per_layer = BudgetSearch(model, calibration).importance(2, 4, ranking)
    grouped = BudgetSearch(model, calibration, sensitivity_groups=2)
    scores = grouped.importance(2, 4, ranking)
    assert grouped.layer_groups() == [[0], [1, 2]] and grouped.evaluations == 1 + 2
    assert set(grouped.layer_loss) == {0, 1}
    for group in grouped.layer_groups():
        keys = [k for k in scores if k[0] in group]
        assert sum(scores[k] for k in keys) == pytest.approx(max(grouped.layer_loss[group[0]], 0.0), rel=1e-6)
    assert {k: v for k, v in scores.items() if k[0] == 0} == pytest.approx(
        {k: v for k, v in per_layer.items() if k[0] == 0}, rel=1e-9)
    # Within the group of layers 1 and 2, one sensitivity: scores are proportional to local error.
    probe = LocalErrors(grouped.experts, floor=2)
    grouped.experts.widths = {key: 4 for key in grouped.keys}
    grouped._quantized.experts = probe
    for i in ranking:
        grouped._quantized.logits(calibration.windows[i])
    ratios = {scores[k] / probe.errors[k] for k in scores if k[0] in (1, 2) and probe.errors.get(k, 0) > 0}
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-5)


def test_layer_groups_are_consecutive_and_as_even_as_they_divide(eight_experts):
    search = BudgetSearch(*eight_experts, sensitivity_groups=8)
    search.keys = [(layer, 0) for layer in range(1, 31)]      # 30 MoE layers, the first dense
    groups = search.layer_groups()
    assert [layer for group in groups for layer in group] == list(range(1, 31))
    assert sorted({len(g) for g in groups}) == [3, 4] and len(groups) == 8
    for per_layer in (64, None):      # None, the default: one group per layer
        search.sensitivity_groups = per_layer
        assert search.layer_groups() == [[layer] for layer in range(1, 31)]
    with pytest.raises(ValueError, match="sensitivity_groups=0"):
        BudgetSearch(*eight_experts, sensitivity_groups=0)


def test_an_unknown_importance_method_is_named(eight_experts):
    model, calibration = eight_experts
    with pytest.raises(ValueError, match="--importance 'fast'"):
        BudgetSearch(model, calibration, importance="fast")


def test_rerunning_from_a_layer_on_cached_inputs_is_exact(search):
    assert_rerun_from_layer_is_exact(search, [(1, 2), (2, 0)])


def test_budget_zero_keeps_every_expert_at_the_top(search):
    result = search.run(0.0)
    assert set(result.widths.values()) == {8} and result.moved_down == 0


def test_a_huge_budget_puts_every_expert_at_the_floor(search):
    result = search.run(1e6)
    assert set(result.widths.values()) == {2} and result.feasible


def test_a_larger_budget_never_gives_a_larger_store(search):
    def bits(result):
        return sum(result.widths.values())
    uniform = uniform_losses(search)
    budgets = sorted({0.0, *(v * f for v in uniform.values() if v > 0 for f in (0.5, 1.0, 1.5)), 1e6})
    sizes = [bits(search.run(b)) for b in budgets]
    assert sizes == sorted(sizes, reverse=True)
    assert len(set(sizes)) >= 3                     # the budgets do span different stores


def moved_and_kept(search, budget):
    result = search.run(budget)
    assert (result.floor, result.ceiling) == (2, 4) and 0 < result.moved_down < len(search.keys)
    assert result.loss_bound <= budget
    floor = {k for k, b in result.widths.items() if b == result.floor}
    return result, floor, set(search.keys) - floor


def a_budget_between_int2_and_int4(search):
    uniform = uniform_losses(search)
    assert uniform[2] > uniform[4] > uniform[8] > 0
    return (uniform[2] + uniform[4]) / 2


def test_moved_experts_are_the_least_important_and_the_loss_is_within_budget(search):
    exact = BudgetSearch(search.model, search.calib, importance="exact")
    result, floor, ceiling = moved_and_kept(exact, a_budget_between_int2_and_int4(exact))
    assert max(result.importance[k] for k in floor) <= min(result.importance[k] for k in ceiling)
    assert result.boundary == {}


def test_local_importance_reranks_the_experts_near_the_cut_by_exact_importance(eight_experts):
    """The local ranking decides far from the cut; the BOUNDARY experts on each side of its cut are
    ranked by their exact importance, and those moved down are the least important of them."""
    from edgemoe.convert.budget import BOUNDARY

    search = BudgetSearch(*eight_experts)
    result, floor, ceiling = moved_and_kept(search, a_budget_between_int2_and_int4(search))
    band = set(result.boundary)
    assert 0 < len(band) <= 2 * BOUNDARY < len(search.keys)
    assert max((result.importance[k] for k in floor - band), default=-1e9) <= min(result.importance[k] for k in band)
    assert max(result.importance[k] for k in band) <= min((result.importance[k] for k in ceiling - band), default=1e9)
    assert max(result.boundary[k] for k in floor & band) <= min(result.boundary[k] for k in ceiling & band)
    exact = BudgetSearch(*eight_experts, importance="exact").importance(2, 4, search.calib.halves()[0])
    assert result.boundary == pytest.approx({k: exact[k] for k in band}, rel=1e-6, abs=1e-9)
    assert result.to_json()["boundary"] == [[l, e, v] for (l, e), v in sorted(result.boundary.items())]


def test_convert_with_budget_records_widths_importance_and_losses(checkpoint, tmp_path, monkeypatch):
    import edgemoe.convert.writer as writer

    manifest_writes = []
    write = writer.write_json_atomic
    monkeypatch.setattr(writer, "write_json_atomic", lambda path, data: (manifest_writes.append(path),
                                                                         write(path, data)))
    done = convert(checkpoint, tmp_path / "s", budget=QualityBudget(1e6, "top1", heldout_text=TEXT[::-1], context=48),
                   calib_text=TEXT)
    manifest = read_manifest(tmp_path / "s")
    record = manifest.data["budget"]
    assert record["metric"] == "top1" and record["heldout_loss"] == done.heldout_loss
    assert record["importance_method"] == "local"
    assert {e.bits for e in manifest.experts.values()} == {2}
    assert record["widths"] == {str(l): [2] * 4 for l in range(3)}
    assert len(manifest_writes) == 1 and done.profiled and (tmp_path / "s" / "profile.json").exists()
    # The search's packed experts are what a plain INT2 convert quantizes: the same bytes.
    convert(checkpoint, tmp_path / "uniform", bits=2)
    assert (tmp_path / "s" / "experts-00000.bin").read_bytes() == (tmp_path / "uniform" / "experts-00000.bin").read_bytes()


def test_convert_passes_the_importance_method_to_the_search(checkpoint, tmp_path):
    from edgemoe.options import OptionError

    convert(checkpoint, tmp_path / "s", budget=QualityBudget(1e6, "top1", context=48, importance="exact"),
            calib_text=TEXT)
    assert read_manifest(tmp_path / "s").data["budget"]["importance_method"] == "exact"
    with pytest.raises(OptionError, match="importance="):
        QualityBudget(0.05, importance="fast")


@pytest.mark.parametrize("text,value", [("5%", 0.05), ("0.5%", 0.005), ("0.1", 0.1)])
def test_parse_budget(text, value):
    assert parse_budget(text) == pytest.approx(value)


def test_bad_budget_options_are_named(checkpoint):
    with pytest.raises(ValueError, match="--budget 'five'"):
        parse_budget("five")
    model = edgemoe.load(checkpoint)
    with pytest.raises(ValueError, match="--metric 'bleu'"):
        Calibration(model, torch.arange(10), 8, "bleu")
    with pytest.raises(ValueError, match="--confidence 1.2"):
        Calibration(model, torch.arange(10), 8, "ppl", confidence=1.2)


def test_inspect_prints_the_width_map_and_draws_it(checkpoint, tmp_path, monkeypatch, capsys):
    import sys

    from edgemoe.cli import main
    from edgemoe.convert import convert

    spec = edgemoe.load(checkpoint).spec
    widths = {(l, e): (2, 4, 8)[(l + e) % 3] for l in range(spec.num_layers) for e in range(spec.num_experts)}
    convert(checkpoint, tmp_path / "s", widths=widths)
    png = tmp_path / "widths.png"
    monkeypatch.setattr(sys, "argv", ["edgemoe", "inspect", str(tmp_path / "s"), "--plot", str(png)])
    with pytest.raises(SystemExit) as info:
        main()
    out = capsys.readouterr().out
    assert info.value.code == 0 and "bits per expert" in out
    width_table = out.split("bits per expert", 1)[1].splitlines()
    row = next(line for line in width_table if line.strip("│ ").startswith("1 "))
    assert [int(c) for c in row.replace("│", " ").split()[1:]] == [widths[1, e] for e in range(spec.num_experts)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_cached_layer_inputs_stay_exact_with_latent_attention_dense_layers_and_shared_experts(tiny_model):
    """DeepSeek-V3's shape: a dense first layer (no experts to widen), always-on shared experts, and
    cached keys and values of different widths when re-running from a layer."""
    model = edgemoe.load(tiny_model("deepseek_v3"))
    ids = torch.tensor(model.tokenizer.encode(TEXT, add_special_tokens=False))
    search = BudgetSearch(model, Calibration(model, ids, context=48, metric="kl"))
    assert {layer for layer, _ in search.keys} == set(model.spec.moe_layer_ids) == {1, 2}
    assert_rerun_from_layer_is_exact(search, [(1, 5), (2, 0)])


def test_the_search_twin_computes_gpt_oss_experts_with_their_biases(tiny_model):
    """GPT-OSS's experts are not SwiGLU: the search's quantized twin must keep their activation."""
    from edgemoe.experts import DenseExpert, InMemoryExperts
    from edgemoe.quant import dequantize_reference, quantize

    model = edgemoe.load(tiny_model("gpt_oss", swiglu_limit=0.5))
    ids = torch.tensor(model.tokenizer.encode(TEXT, add_special_tokens=False))[:40]
    search = BudgetSearch(model, Calibration(model, ids, context=48, metric="kl"))
    expected = edgemoe.load(tiny_model("gpt_oss", swiglu_limit=0.5))
    expected.experts = InMemoryExperts({key: DenseExpert(**{role: dequantize_reference(quantize(e.weights[role], 8))
                                                           for role in ("gate", "up", "down")}, activation=e.activation)
                                        for key, e in model.experts.experts.items()})
    assert set(search.experts.widths.values()) == {8}
    assert (search._quantized.logits(ids) - expected.logits(ids)).abs().max() <= 1e-4
