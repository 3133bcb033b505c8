"""Streaming calibration (docs/budget.md): the search run layer by layer chooses what the search
that held the whole model chose, its memory stays bounded by one layer's experts, and its work
files never outlive the convert."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import edgemoe
from edgemoe.convert import QualityBudget, convert
from edgemoe.convert.budget import BATCH_TOKENS, BudgetSearch, Calibration

from test_budget import TEXT

REPO = Path(__file__).resolve().parent.parent

# What the search that loaded the whole model and evaluated window by window (before streaming
# calibration) chose with convert(..., budget=QualityBudget(BUDGET, "kl", context=48),
# calib_text=TEXT * 4): the uniform losses, the bound, the widths. Recorded on an AVX-512 CPU: torch's
# float32 products sum in an order that depends on the CPU's vector width, so on another CPU the
# losses move in their last digits (an AVX2-only EPYC: up to 1e-5 relative, on the smallest loss);
# the widths, the search's decision, must not move. That the streamed evaluation equals the whole
# one bit for bit, on one machine, is the next test's.
LOSS_RTOL = 1e-4
RECORDED = {
    "mixtral": ({"num_hidden_layers": 3, "num_local_experts": 8}, 0.125098,
                {2: 0.32390728140826414, 4: 0.025693314118015495, 8: 0.0004595956731876569}, 0.1027023024455225,
                {"0": [2, 4, 4, 4, 4, 2, 4, 2], "1": [2, 2, 4, 2, 2, 4, 4, 4], "2": [2, 2, 2, 2, 2, 4, 4, 2]}),
    "deepseek_v3": ({}, 0.096005,
                    {2: 0.24674608614155097, 4: 0.02063424552886062, 8: 0.0006562103062718544}, 0.07761447661451912,
                    {"1": [4, 4, 4, 2, 4, 4, 2, 2], "2": [2, 2, 4, 2, 4, 2, 2, 2]}),
}


@pytest.mark.parametrize("arch", sorted(RECORDED))
def test_the_streamed_search_chooses_what_the_whole_model_search_chose(tiny_model, tmp_path, arch):
    overrides, budget, uniform, bound, widths = RECORDED[arch]
    done = convert(tiny_model(arch, **overrides), tmp_path / "s", budget=QualityBudget(budget, "kl", context=48),
                   calib_text=TEXT * 4)
    # Widths are measured narrowest first up to the first within the budget (INT4 here).
    assert list(done.search.uniform_loss) == [2, 4]
    for bits, loss in done.search.uniform_loss.items():
        assert loss == pytest.approx(uniform[bits], rel=LOSS_RTOL)
    assert done.search.loss_bound == pytest.approx(bound, rel=LOSS_RTOL)
    assert done.search.to_json()["widths"] == widths


def test_a_layer_by_layer_evaluation_is_each_windows_whole_forward_pass(tiny_model):
    """The loss of a mix, evaluated layer by layer from work files, equals (bit for bit) the one of
    each batch of windows' forward pass through the whole twin, and that of each window's own
    forward pass but for the rounding of batched products; the reference computed layer by layer
    from experts read lazily equals the one of the model loaded whole."""
    checkpoint = tiny_model("mixtral", num_hidden_layers=3, num_local_experts=8)
    model = edgemoe.load(checkpoint)
    ids = torch.tensor(model.tokenizer.encode(TEXT * 2, add_special_tokens=False))
    calibration = Calibration(model, ids, context=48, metric="kl")
    every = range(len(calibration.windows))
    batches = calibration.batches(every, BATCH_TOKENS)
    assert max(len(b) for b in batches) > 1      # windows do share a layer's calls
    with BudgetSearch(model, calibration) as search:
        mix = {key: (2, 4, 8)[(key[0] + key[1]) % 3] for key in search.keys}
        layered = search.loss(mix)
        search.experts.release()
        whole = {i: calibration.window_loss(i, logits) for batch in batches
                 for i, logits in zip(batch, calibration.predict_batch(search._quantized, batch))}
        alone = {i: calibration.window_loss(i, calibration.predict(search._quantized, i)) for i in every}
    assert layered == calibration.loss(whole)
    assert calibration.loss(alone) == pytest.approx(layered, rel=1e-5)
    from edgemoe.checkpoint import Checkpoint
    from edgemoe.loader import model_from_checkpoint, plan_checkpoint
    ckpt = Checkpoint(checkpoint)
    lazy = model_from_checkpoint(ckpt, plan_checkpoint(ckpt), lazy_experts=True)
    streamed = Calibration(lazy.spec, ids, context=48, metric="kl")
    with BudgetSearch(lazy, streamed):
        assert all(torch.equal(a, b) for a, b in zip(streamed.reference, calibration.reference))
        assert streamed.reference_nll == calibration.reference_nll
    ckpt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windows_loss_has_the_same_bits_in_a_pass_over_its_half_as_over_all_windows(tiny_model, dtype):
    """A window meets the same batch whichever pass computes it (Calibration.batches), so the loss the
    search keeps for it is the one a pass over only its half gives: in float32 and in bfloat16
    (the twin's experts multiply in the dense matrices' type)."""
    model = edgemoe.load(tiny_model("mixtral", num_hidden_layers=3, num_local_experts=8), dtype=dtype)
    ids = torch.tensor(model.tokenizer.encode(TEXT * 2, add_special_tokens=False))
    calibration = Calibration(model, ids, context=48, metric="kl")
    ranking, choosing = calibration.halves()
    assert max(len(b) for b in calibration.batches(ranking, BATCH_TOKENS)) > 1
    with BudgetSearch(model, calibration) as over_all, BudgetSearch(model, calibration) as over_halves:
        assert over_all.experts.gemm_dtype == dtype
        mix = {key: (2, 4, 8)[(key[0] + key[1]) % 3] for key in over_all.keys}
        over_all.loss(mix)
        evaluations = over_all.evaluations
        for half in (ranking, choosing):
            assert over_all.loss(mix, windows=half) == over_halves.loss(mix, windows=half)
        assert over_all.evaluations == evaluations and over_halves.evaluations == 2


def test_an_interrupted_convert_leaves_no_work_file_and_no_store(tiny_model, tmp_path):
    """Interrupted mid-search (its packed experts and layer inputs on disk), the convert removes
    them with the partial store; a finished store holds none of them."""
    checkpoint = tiny_model("mixtral", num_hidden_layers=3, num_local_experts=8)
    seen = []

    def interrupt(stage, done, total):
        if stage == "importance":
            seen.extend(p.name for p in tmp_path.glob("s.partial-*/search-*/*"))
            raise KeyboardInterrupt

    budget = QualityBudget(0.125098, "kl", context=48)
    with pytest.raises(KeyboardInterrupt):
        convert(checkpoint, tmp_path / "s", budget=budget, calib_text=TEXT * 4, progress=interrupt)
    assert {"packed.bin", "states.bin", "inputs.bin"} <= set(seen)
    assert list(tmp_path.iterdir()) == []
    convert(checkpoint, tmp_path / "s", budget=budget, calib_text=TEXT * 4)
    assert [p.name for p in tmp_path.iterdir()] == ["s"]
    assert not list((tmp_path / "s").glob("search-*")) and (tmp_path / "s" / "manifest.json").exists()


MEASURE = """
import json, sys
from edgemoe.convert import QualityBudget, convert

def status(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

warm, big, out, calib = sys.argv[1:]
text = open(calib, encoding="utf-8").read()[:20000]
budget = QualityBudget(0.05, "kl", context=64, calib_tokens=256)
convert(warm, out + "-warm", budget=budget, calib_text=text, threads=1, profile_tokens=64)   # compiles the kernels
peak = {}

def at_profiling(stage, done, total):
    # The search and the store's writing are done: their peak (the profiling pass is not the search's).
    if stage == "profiling routing" and not peak:
        peak["search"] = status("VmHWM")

before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")                              # VmHWM := VmRSS
done = convert(big, out, budget=budget, calib_text=text, threads=1, progress=at_profiling, profile_tokens=64)
print(json.dumps({"growth": peak["search"] - before, "moved_down": done.search.moved_down}))
"""


def synthetic(out: Path, layers: int, experts: int, hidden: int, expert_hidden: int) -> Path:
    """A random bfloat16 Mixtral-shaped checkpoint (tools/make_synthetic_model.py)."""
    subprocess.run([sys.executable, str(REPO / "tools" / "make_synthetic_model.py"), "--out", str(out),
                    "--layers", str(layers), "--experts", str(experts), "--hidden", str(hidden), "--expert-hidden",
                    str(expert_hidden), "--vocab", "1024", "--heads", "4", "--kv-heads", "2",
                    "--max-positions", "256"], check=True, capture_output=True)
    return out


def test_the_search_memory_is_bounded_by_one_layer_not_the_model(tmp_path):
    """A 16-layer model whose experts (as stored and packed at three widths) are about 190 MB,
    converted under a budget in a process that first converted a 2-layer model of the same shapes
    (so that compiling kernels, paid once, is not counted): until the store is written (the search
    and the writing; profiling the store's routing comes after) its peak RSS grows by less than one
    layer's experts in every form the search holds them (float32 as read, packed at three widths,
    dequantized float32 at two widths) and two layers' packed, plus 64 MiB for the rest."""
    layers, experts, hidden, expert_hidden = 16, 8, 256, 512
    big = synthetic(tmp_path / "big", layers, experts, hidden, expert_hidden)
    warm = synthetic(tmp_path / "warm", 2, experts, hidden, expert_hidden)
    layer_weights = experts * 3 * hidden * expert_hidden
    model_bytes = layers * layer_weights * (2 + 1.75)      # bfloat16 as stored, packed at 2 + 4 + 8 bits
    bound = layer_weights * (4 + 1.75 + 2 * 4 + 2 * 1) + 64 * 2**20
    assert model_bytes > 1.5 * bound
    calib = REPO / "edgemoe" / "bundled" / "shakespeare-moe" / "calib.txt"
    run = subprocess.run([sys.executable, "-c", MEASURE, str(warm), str(big), str(tmp_path / "s"), str(calib)],
                         check=True, capture_output=True, text=True)
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["moved_down"] > 0          # the whole search ran: importance, binary search, boundary
    assert measured["growth"] < bound, f"peak RSS grew by {measured['growth'] / 2**20:.0f} MiB"
