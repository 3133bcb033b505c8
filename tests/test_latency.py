"""The latency model: fitted from timings, chooses the cheaper path, cached per machine and shape."""

import json

import pytest
import torch

import edgemoe
from edgemoe import latency
from edgemoe.latency import LatencyModel, load_or_calibrate
from edgemoe.convert import convert


def fake_timings(monkeypatch, fused_slope=1e-3, dequant_base=5e-3):
    """fused-int: t = S * fused_slope; fused-float 1.5x that; dequant: t = dequant_base + 1e-5 * S
    (as on a real CPU, roughly)."""
    calls = []

    def fake_calibrate(shape, widths, repeats=3, tokens=latency.CALIBRATION_TOKENS, device=None,
                       gemm_dtype=torch.float32):
        calls.append(tuple(sorted(widths)) + (() if gemm_dtype == torch.float32 else (str(gemm_dtype),)))
        fits = {"fused-int": {b: latency._fit(tokens, [s * fused_slope * b / 4 for s in tokens]) for b in widths},
                "fused-float": {b: latency._fit(tokens, [1.5 * s * fused_slope * b / 4 for s in tokens])
                                for b in widths},
                "dequant": {b: latency._fit(tokens, [dequant_base + 1e-5 * s for s in tokens]) for b in widths}}
        return LatencyModel(fits, tuple(shape), latency.machine_fingerprint())

    monkeypatch.setattr(latency, "calibrate", fake_calibrate)
    return calls


def test_choice_switches_at_the_measured_crossover(monkeypatch, tmp_path):
    fake_timings(monkeypatch)
    model = load_or_calibrate((96, 64), [4, 8], path=tmp_path / "l.json")
    # fused 1e-3*S vs dequant 5e-3 + 1e-5*S: dequant is cheaper from S = 6 at INT4; INT8 costs 2x: S = 3
    assert [model.choose(4, s) for s in (1, 5, 6, 64)] == ["fused-int", "fused-int", "dequant", "dequant"]
    assert model.crossover(4) == 6 and model.crossover(8) == 3


def test_calibration_is_cached_per_shape_and_extended_for_new_widths(monkeypatch, tmp_path):
    calls = fake_timings(monkeypatch)
    path = tmp_path / "l.json"
    load_or_calibrate((96, 64), [4], path=path)
    load_or_calibrate((96, 64), [4], path=path)
    assert calls == [(4,)]
    load_or_calibrate((96, 64), [2], path=path)          # a width not calibrated yet: redo with the union
    load_or_calibrate((48, 64), [4], path=path)          # another shape
    assert calls == [(4,), (2, 4), (4,)]
    assert len(json.loads(path.read_text())) == 2


def test_a_bfloat16_dequant_path_is_calibrated_apart(monkeypatch, tmp_path):
    """The "dequant" path's time depends on the type it multiplies in: each type its own entry."""
    calls = fake_timings(monkeypatch)
    path = tmp_path / "l.json"
    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
        load_or_calibrate((96, 64), [4], path=path, gemm_dtype=dtype)
    assert calls == [(4,), (4, "torch.bfloat16")] and len(json.loads(path.read_text())) == 2


def test_corrupt_cache_is_recalibrated(monkeypatch, tmp_path):
    calls = fake_timings(monkeypatch)
    path = tmp_path / "l.json"
    path.write_text("{not json")
    assert load_or_calibrate((96, 64), [4], path=path).choose(4, 1) == "fused-int"
    assert calls == [(4,)] and json.loads(path.read_text())


def test_a_cache_without_the_integer_path_is_recalibrated(monkeypatch, tmp_path):
    calls = fake_timings(monkeypatch)
    path = tmp_path / "l.json"
    old = LatencyModel({"fused": {4: (0.0, 1e-3)}, "dequant": {4: (5e-3, 1e-5)}}, (96, 64), latency.machine_fingerprint())
    path.write_text(json.dumps({latency._cache_key((96, 64), old.machine, None): old.to_json()}))
    assert load_or_calibrate((96, 64), [4], path=path).choose(4, 1) == "fused-int"
    assert calls == [(4,)]


def test_real_calibration_fits_nonnegative_lines():
    model = latency.calibrate((32, 64), [4], repeats=1, tokens=(1, 8))
    for path in latency.PATHS:
        a, b = model.fits[path][4]
        assert a >= 0 and b >= 0 and model.predict(path, 4, 8) >= model.predict(path, 4, 1)


@pytest.mark.parametrize("compute", ["auto", "fused-int", "dequant"])
def test_every_compute_path_gives_the_same_logits(tiny_model, tmp_path, compute):
    """Float paths agree to float rounding. The integer path (auto's choice for a few tokens when it is
    the fastest) differs by int8 activation rounding, which on this random model moves the logits by up
    to 8% of the largest (measured KL 2.9e-4, top-1 agreement 23 of 24 tokens): held to KL <= 2e-3.
    tests/test_int_kernels.py bounds the kernels themselves; the bundled model's text is checked there."""
    convert(tiny_model("olmoe"), tmp_path / "s", bits=4)
    fused = edgemoe.load(tmp_path / "s", compute="fused-float")
    model = edgemoe.load(tmp_path / "s", compute=compute)
    ids = torch.tensor(fused.tokenizer.encode("All the world's a stage, and all the men and women"))
    chosen, choose = [], model.experts.choose       # the paths this forward really took (auto: by token count)
    model.experts.choose = lambda bits, tokens, nbytes=0: chosen.append(choose(bits, tokens, nbytes)) or chosen[-1]
    expected, got = fused.logits(ids), model.logits(ids)
    if "fused-int" in chosen:
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True,
                                        reduction="batchmean")
        assert 0 < kl <= 2e-3
    else:
        assert (got - expected).abs().max() <= 1e-4


def test_unknown_compute_choice_is_named(tiny_model, tmp_path):
    convert(tiny_model("olmoe"), tmp_path / "s", bits=4)
    with pytest.raises(ValueError, match="compute='gpu'"):
        edgemoe.load(tmp_path / "s", compute="gpu")


def test_device_path_wins_for_many_tokens_when_the_copy_is_cheap():
    fits = {"fused-int": {4: (0.0, 1e-3)}, "fused-float": {4: (0.0, 2e-3)}, "dequant": {4: (5e-3, 1e-4)},
            "device": {4: (1e-3, 1e-6)}}
    model = LatencyModel(fits, (96, 64), "m", device="cuda", copy_seconds_per_byte=1e-9)
    assert model.choose(4, 1, nbytes=10_000) == "fused-int"      # 1 ms vs 1.01 ms on the device
    assert model.choose(4, 64, nbytes=10_000) == "device"        # 64 ms, 11.4 ms, 1.07 ms
    assert model.choose(4, 64, nbytes=10**8) == "dequant"        # a 0.1 s copy loses to 11.4 ms
    assert LatencyModel.from_json(model.to_json()) == model


def test_real_calibration_of_the_device_path(vram_device):
    model = latency.calibrate((32, 64), [4], repeats=1, tokens=(1, 8), device=vram_device)
    assert set(model.fits) == {*latency.PATHS, "device"} and model.copy_seconds_per_byte > 0
    assert model.choose(4, 8, nbytes=1000) in model.fits


def test_device_compute_gives_the_same_logits(tiny_model, tmp_path, vram_device):
    convert(tiny_model("qwen2_moe"), tmp_path / "s", bits=4)
    fused = edgemoe.load(tmp_path / "s", compute="fused-float")
    on_device = edgemoe.load(tmp_path / "s", compute="device", ram="1GB", vram=1, device=vram_device)
    ids = torch.tensor(fused.tokenizer.encode("All the world's a stage, and all the men"))
    assert (on_device.logits(ids) - fused.logits(ids)).abs().max() <= 1e-4
    assert on_device.store.resident() and set(on_device.store.resident().values()) == {"ram"}
    with pytest.raises(ValueError, match="needs a VRAM tier"):
        edgemoe.load(tmp_path / "s", compute="device")


def test_the_latency_model_is_asked_for_at_load_not_on_a_first_step(tiny_model, tmp_path, monkeypatch):
    """compute="auto": the loader gets the latency model (a calibration unless cached) before the first
    step, so no step's time includes it; a forced path never asks for one."""
    convert(tiny_model("mixtral"), tmp_path / "s", bits=4)
    calls = fake_timings(monkeypatch)
    monkeypatch.setattr(latency, "cache_file", lambda: tmp_path / "latency.json")
    with edgemoe.load(tmp_path / "s") as model:
        assert calls == [(4,)] and model.experts.latency is not None
        model.logits([5, 6, 7])
        assert calls == [(4,)]
    with edgemoe.load(tmp_path / "s", compute="dequant") as model:
        assert model.experts.latency is None
    assert calls == [(4,)]


def test_calibration_times_the_fastest_run(monkeypatch):
    """A run slowed by contention (here the second of three: 50 ms against 1 ms) must not be the one kept."""
    clock = iter([0.0, 0.001, 1.0, 1.050, 2.0, 2.001])
    monkeypatch.setattr(latency.time, "perf_counter", lambda: next(clock))
    assert latency.fastest_time(lambda: None, 3) == pytest.approx(0.001)


def test_fused_float_is_never_the_automatic_choice():
    """Even where its fit predicts it cheapest (a calibration from before, or a near tie at one token):
    the layer kernel computes fused-int experts in one call, fused-float one call each."""
    fits = {"fused-int": {8: (2.6e-5, 2.1e-5)}, "fused-float": {8: (0.8e-5, 3.5e-5)}, "dequant": {8: (3e-4, 6e-6)}}
    model = LatencyModel(fits, (384, 1024), "m")
    assert model.choose(8, 1) == "fused-int" and model.choose(8, 64) == "dequant"
