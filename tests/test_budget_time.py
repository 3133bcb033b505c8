"""The quality search's time target (docs/budget.md, Method, "A time target"): its pass count is the
search's own, the windows it keeps are evenly spread and used for everything, and a convert under
a target searches exactly as a search given those windows by hand would."""

import pytest
import torch

import edgemoe
from edgemoe.commands import convert as convert_command
from edgemoe.convert import QualityBudget, convert, pipeline
from edgemoe.convert import budget as budget_module
from edgemoe.convert.budget import (MIN_SAMPLE_WINDOWS, BudgetSearch, Calibration, projected_passes,
                                    sample_for_time, spread)
from edgemoe.checkpoint import Checkpoint
from edgemoe.loader import CheckpointExperts, model_from_checkpoint, plan_checkpoint
from edgemoe.store import read_manifest

from test_budget import TEXT


def test_spread_keeps_the_middle_of_equal_parts():
    assert spread(4, 8) == [1, 3, 5, 7]
    assert spread(3, 3) == [0, 1, 2]
    assert spread(1, 5) == [2]
    for total in range(1, 60):
        for count in range(1, total + 1):
            kept = spread(count, total)
            assert len(set(kept)) == count and kept == sorted(kept) and 0 <= kept[0] and kept[-1] < total


def test_the_projected_passes_are_the_documented_counts():
    """docs/budget.md's table of passes: bench-qwen3moe, Mixtral-8x7B, Qwen3-30B-A3B."""
    for layers, experts, local, exact in ((24, 1536, 23.5, 394.5), (32, 256, 24.5, 73.5), (48, 6144, 30.5, 1547.5)):
        assert projected_passes(layers, experts, "local") == local
        assert projected_passes(layers, experts, "exact") == exact


@pytest.mark.parametrize("importance,limit", [("local", 0.005), ("local", 0.01), ("exact", 0.005)])
def test_the_projected_passes_bound_a_searchs_work(tiny_model, monkeypatch, importance, limit):
    """A search that ranks and counts (ceiling INT8, as the projection assumes) computes, counting its
    reference pass, the projected passes within 30% (here 0.96-1.09 of them: the count searches take
    a binary search's count or a few more or fewer, the last step a few more)."""
    checkpoint = tiny_model("mixtral", num_hidden_layers=3, num_local_experts=8)
    lazy = lazy_model(checkpoint)
    ids = torch.tensor(lazy.tokenizer.encode(TEXT * 4, add_special_tokens=False))
    calibration = Calibration(lazy.spec, ids, context=32, metric="kl")
    window_layers = []
    through = BudgetSearch._through_layer
    monkeypatch.setattr(BudgetSearch, "_through_layer", lambda self, layer, windows, *args: (
        window_layers.append(len(list(windows))), through(self, layer, windows, *args))[1])
    with BudgetSearch(lazy, calibration, importance=importance) as search:
        result = search.run(limit)
    assert result.ceiling == 8 and 0 < result.moved_down < len(search.keys)
    passes = sum(window_layers) / (len(calibration.windows) * lazy.spec.num_layers)
    projected = projected_passes(len(lazy.spec.moe_layer_ids), len(search.keys), importance)
    assert 0.7 * projected <= passes <= 1.3 * projected


def lazy_model(checkpoint):
    """The model with its experts read from the checkpoint as asked for, as convert's search has it."""
    ckpt = Checkpoint(checkpoint)
    return model_from_checkpoint(ckpt, plan_checkpoint(ckpt), lazy_experts=True)


def fake_cost(seconds_per_token):
    def measured(model, calib):
        return seconds_per_token
    return measured


def test_a_time_target_keeps_as_many_spread_windows_as_fit(tiny_model, monkeypatch):
    model = edgemoe.load(tiny_model("mixtral", num_hidden_layers=3, num_local_experts=8))
    ids = torch.tensor(model.tokenizer.encode(TEXT * 12, add_special_tokens=False))
    given = Calibration(model.spec, ids, context=16, metric="kl")
    windows, tokens = list(given.windows), given.tokens
    assert len(windows) > 2 * MIN_SAMPLE_WINDOWS
    passes = projected_passes(len(model.spec.moe_layer_ids), len(model.spec.moe_layer_ids) * model.spec.num_experts,
                              "local")
    all_seconds = passes * 1e-3 * tokens
    monkeypatch.setattr(budget_module, "pass_seconds_per_token", fake_cost(1e-3))

    fits = Calibration(model.spec, ids, context=16, metric="kl")
    sample = sample_for_time(model, fits, all_seconds / 60 * 1.01)
    assert (sample.windows, sample.of, len(fits.windows)) == (len(windows), len(windows), len(windows))

    half = Calibration(model.spec, ids, context=16, metric="kl")
    sample = sample_for_time(model, half, all_seconds / 60 / 2)
    expected = int(len(windows) / 2)       # each window costs the same share of the projection
    assert expected - 1 <= sample.windows <= expected
    assert [w.tolist() for w in half.windows] == [windows[i].tolist() for i in spread(sample.windows, len(windows))]
    assert sample.tokens == half.tokens < tokens and sample.of_tokens == tokens
    assert sample.projected_seconds() <= all_seconds / 2 < sample.projected_seconds(tokens)

    least = Calibration(model.spec, ids, context=16, metric="kl")
    assert sample_for_time(model, least, 1e-9).windows == MIN_SAMPLE_WINDOWS == len(least.windows)


def test_windows_are_kept_only_before_a_reference():
    calibration = Calibration.__new__(Calibration)
    calibration.reference, calibration.windows = [], [torch.arange(3)] * 4
    for bad in ([], [2, 1], [0, 0], [0, 4]):
        with pytest.raises(ValueError, match="increasing window indices"):
            calibration.keep(bad)
    calibration.reference = [torch.zeros(2)]
    with pytest.raises(ValueError, match="reference of some windows"):
        calibration.keep([0])


def test_the_cost_is_measured_without_reading_an_expert_twice(tiny_model, monkeypatch):
    """The probe runs the first layer's experts; the search reads that layer next, from those held."""
    checkpoint = tiny_model("mixtral", num_hidden_layers=3, num_local_experts=8)
    reads = []
    read = CheckpointExperts.read
    monkeypatch.setattr(CheckpointExperts, "read", lambda self, key: reads.append(key) or read(self, key))
    lazy = lazy_model(checkpoint)
    ids = torch.tensor(lazy.tokenizer.encode(TEXT * 4, add_special_tokens=False))
    calibration = Calibration(lazy.spec, ids, context=32, metric="kl")
    assert budget_module.pass_seconds_per_token(lazy, calibration) > 0
    assert reads and {layer for layer, _ in reads} == {0}
    with BudgetSearch(lazy, calibration):
        pass
    assert len(reads) == len(set(reads)) == len(lazy.spec.moe_layer_ids) * lazy.spec.num_experts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_convert_under_a_time_target_searches_as_on_those_windows_by_hand(tiny_model, tmp_path, monkeypatch,
                                                                            dtype):
    checkpoint = tiny_model("mixtral", num_hidden_layers=3, num_local_experts=8, dtype=dtype)
    text = TEXT * 6
    notices = []
    done = convert(checkpoint, tmp_path / "s", budget=QualityBudget(0.05, "kl", context=16, search_minutes=1e-6),
                   calib_text=text, notice=notices.append)
    sample = done.sample
    assert sample.windows == MIN_SAMPLE_WINDOWS < sample.of
    assert len(notices) == 1 and f"{MIN_SAMPLE_WINDOWS} of {sample.of} calibration windows" in notices[0]
    assert "over its time target of 1e-06 min" in notices[0]       # 16 windows are the fewest it uses
    assert read_manifest(tmp_path / "s").data["budget"]["sample"] == sample.to_json()

    model = edgemoe.load(checkpoint)       # loaded whole: its reference computed independently
    ids = torch.tensor(model.tokenizer.encode(text, add_special_tokens=False))
    by_hand = Calibration(model.spec, ids, context=16, metric="kl")
    by_hand.keep(spread(MIN_SAMPLE_WINDOWS, sample.of))
    by_hand.compute_reference(model)
    with BudgetSearch(model, by_hand) as search:
        expected = search.run(0.05)
    assert done.search.widths == expected.widths
    assert done.search.loss_bound == expected.loss_bound and done.search.uniform_loss == expected.uniform_loss

    untimed = convert(checkpoint, tmp_path / "all", budget=QualityBudget(0.05, "kl", context=16, search_minutes=None),
                      calib_text=text, notice=notices.append)
    assert untimed.sample is None and read_manifest(tmp_path / "all").data["budget"]["sample"] is None
    fitting = convert(checkpoint, tmp_path / "fits", budget=QualityBudget(0.05, "kl", context=16), calib_text=text,
                      notice=notices.append)
    assert fitting.sample.windows == fitting.sample.of == sample.of     # a tiny model's search fits 10 minutes
    assert len(notices) == 2 and notices[1].startswith("the quality search is projected at")
    assert fitting.search.widths == untimed.search.widths and fitting.search.loss_bound == untimed.search.loss_bound


def test_the_command_line_default_is_the_librarys():
    assert convert_command.SEARCH_MINUTES == pipeline.SEARCH_MINUTES == QualityBudget(0.05).search_minutes
