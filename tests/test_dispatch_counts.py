"""The decode step's call counts, counted (not timed, so a noisy machine cannot fool it): numba
kernel dispatches and torch calls per MoE layer of one decode step, while the store is still
reading experts (layer by layer) and once every expert is resident (one call for every layer). A bound
that fails is overhead creeping back into the hot path (DESIGN: a few kernel calls per layer cost
well under a millisecond a token; the Python around the calls is what costs).

Bounds: the experts' part (StoreExperts.prepare and run) makes 3 numba dispatches a layer (the
layer kernel's argument check, the kernel and the ordered weighted sum) and under 30 torch calls.
The whole step, with the decode engine (edgemoe/decode.py): 6 dispatches a layer (its attention
block, the router's choice, the experts' 3, and the step's LM head shared among the layers) and
under 70 torch calls a layer (66 measured on these two-layer models, whose per-step calls weigh
more than on a deep model; the generic forward made ~170). Every expert resident: 2 dispatches a
step (DecodeEngine.step's one call for every layer, the LM head) and under 65 torch calls a step
(62 measured: positions, rotary table, embedding, LM head, the step's own arrays and the hooks'
views of its routing), the same at any depth: none per layer."""

import numba
import pytest
import torch
from torch.overrides import TorchFunctionMode

import edgemoe
from edgemoe.convert import convert
from edgemoe.kernels import cpu, cpu_int, cpu_layer
from edgemoe.model import Segment

EXPERT_DISPATCHES_PER_LAYER = 3
EXPERT_TORCH_CALLS_PER_LAYER = 30
STEP_TORCH_CALLS_PER_LAYER = 70
STEP_DISPATCHES_PER_LAYER = 6
RESIDENT_STEP_DISPATCHES = 2
RESIDENT_STEP_TORCH_CALLS = 65


class TorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def numba_dispatches(monkeypatch):
    """Counts every call into a numba kernel from Python (the kernels' modules' dispatchers).

    A kernel compiled during a counted call looks its callees up in its module's globals, so the
    counted call puts the real dispatchers back for its length (kernels never call into Python)."""
    counter = {"calls": 0}
    kernels = [(module, name, kernel) for module in (cpu, cpu_int, cpu_layer)
               for name, kernel in list(vars(module).items())
               if isinstance(kernel, numba.core.registry.CPUDispatcher)]
    wrappers = []

    def set_all(values):
        for (module, name, _), value in zip(kernels, values):
            setattr(module, name, value)

    def counted_call(kernel):
        def counted(*args, **kwargs):
            counter["calls"] += 1
            set_all(kernel for _, _, kernel in kernels)
            try:
                return kernel(*args, **kwargs)
            finally:
                set_all(wrappers)
        return counted

    for module, name, kernel in kernels:
        wrappers.append(counted_call(kernel))
        monkeypatch.setattr(module, name, wrappers[-1])
    return counter


def count_experts_part(model, counter):
    """Wrap the expert provider's prepare and run to count their torch calls and dispatches."""
    counts = {"torch": 0, "numba": 0}
    for name in ("prepare", "run"):
        method = getattr(model.experts, name)

        def counted(*args, _method=method, **kwargs):
            before = counter["calls"]
            with TorchCalls() as calls:
                result = _method(*args, **kwargs)
            counts["torch"] += calls.count
            counts["numba"] += counter["calls"] - before
            return result
        setattr(model.experts, name, counted)
    return counts


@pytest.mark.parametrize("arch, overrides", [("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 8}),
                                             ("mixtral", {}),
                                             ("gpt_oss", {"num_local_experts": 16, "num_experts_per_tok": 2})])
def test_one_decode_step_stays_within_its_call_counts(tiny_model, tmp_path, numba_dispatches, arch, overrides):
    convert(tiny_model(arch, **overrides), tmp_path / "s", bits=4)
    with edgemoe.load(tmp_path / "s", compute="fused-int", dense_bits=8) as model:   # the commands' default
        layers = len(model.spec.moe_layer_ids)
        cache = model.new_cache()
        token = int(model.forward(torch.arange(6), [Segment(cache, 6)], last_only=True)[-1].argmax())
        for _ in range(2):   # every expert path warmed
            token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)[-1].argmax())
        experts = count_experts_part(model, numba_dispatches)
        before = numba_dispatches["calls"]
        with TorchCalls() as step:
            model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)
    assert model.decode_engine is not None
    assert numba_dispatches["calls"] - before <= STEP_DISPATCHES_PER_LAYER * layers
    assert experts["numba"] == EXPERT_DISPATCHES_PER_LAYER * layers
    assert experts["torch"] <= EXPERT_TORCH_CALLS_PER_LAYER * layers, experts
    assert step.count <= STEP_TORCH_CALLS_PER_LAYER * layers, step.count


def resident_step_counts(tiny_model, path, numba_dispatches, arch, overrides):
    """(numba dispatches, torch calls) of one decode step with every expert resident."""
    convert(tiny_model(arch, **overrides), path, bits=4)
    with edgemoe.load(path, compute="fused-int", dense_bits=8) as model:
        for entry in model.store.experts():
            model.store.get(*entry.key)
        cache = model.new_cache()
        token = int(model.forward(torch.arange(6), [Segment(cache, 6)], last_only=True)[-1].argmax())
        for _ in range(2):
            token = int(model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)[-1].argmax())
        before = numba_dispatches["calls"]
        with TorchCalls() as step:
            model.forward(torch.tensor([token]), [Segment(cache, 1)], last_only=True)
    return numba_dispatches["calls"] - before, step.count


@pytest.mark.parametrize("arch, overrides", [("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 8}),
                                             ("mixtral", {}),
                                             ("gpt_oss", {"num_local_experts": 16, "num_experts_per_tok": 2})])
def test_a_step_with_every_expert_resident_is_one_call_for_the_layers(tiny_model, tmp_path, numba_dispatches,
                                                                      arch, overrides):
    """The same counts at two depths: nothing is called per layer."""
    shallow = resident_step_counts(tiny_model, tmp_path / "2", numba_dispatches, arch, overrides)
    deep = resident_step_counts(tiny_model, tmp_path / "4", numba_dispatches, arch,
                                dict(overrides, num_hidden_layers=4))
    assert shallow == deep
    assert shallow[0] == RESIDENT_STEP_DISPATCHES and shallow[1] <= RESIDENT_STEP_TORCH_CALLS, shallow
