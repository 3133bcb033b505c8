"""GPT-OSS beyond logit parity (tests/test_parity.py): the MXFP4 decoder against transformers' own and a
written-out e2m1 table, the expert's computation on every compute path against a plain torch
twin, a converted store run on each path (and the device path with the CPU standing in), the eval
command on a store, and malformed checkpoints refused with the tensor named."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import edgemoe
from edgemoe import quantized
from edgemoe.convert import convert
from edgemoe.errors import CheckpointError
from edgemoe.evaluate import evaluate
from edgemoe.experts import DenseExpert, InMemoryExperts, dense_matmul
from edgemoe.kernels import dequantize, int_paths, qmatmul, qmatmul_int
from edgemoe.kernels.ops import expert_layout, gpt_oss_arrays, gpt_oss_layout, swiglu_experts_int
from edgemoe.kernels.activations import gpt_oss_expert
from edgemoe.kernels.reference import gpt_oss_reference
from edgemoe.mxfp4 import decode_mxfp4
from edgemoe.quant import dequantize_reference, quantize
from edgemoe.spec import ModelSpec
from edgemoe.store import read_manifest
from edgemoe.store.format import MANIFEST

from helpers import acts, decode, weights

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"


def test_mxfp4_decodes_as_the_e2m1_table_says():
    # one block: codes 0..15 in byte order (low nibble first), then 16 zero codes; scale 2^(129-127) = 4
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, :8] = codes[0::2] | (codes[1::2] << 4)
    scales = torch.tensor([[129]], dtype=torch.uint8)
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert decode_mxfp4(blocks, scales).tolist() == [[4 * v for v in table] + [0.0] * 16]   # [1, 32]
    assert decode_mxfp4(blocks, torch.tensor([[127 - 3]], dtype=torch.uint8))[0, 7].item() == 6 / 8


def test_mxfp4_matches_transformers_dequantization():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=g)
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)   # [E, C, R]: transposed
    assert torch.equal(decode_mxfp4(blocks, scales), expected.transpose(1, 2))


def test_mxfp4_refuses_mismatched_blocks_and_scales():
    with pytest.raises(CheckpointError, match="w_blocks: MXFP4 blocks .* do not match scales"):
        decode_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), "w_blocks")
    with pytest.raises(CheckpointError, match="must be uint8"):
        decode_mxfp4(torch.zeros(2, 3, 16), torch.zeros(2, 3, dtype=torch.uint8))


def expert_case(bits, tokens, limit, seed=0):
    dim, inner = 64, 96
    qts = {"gate": quantize(weights(inner, dim, seed + 1) * 20, bits),
           "up": quantize(weights(inner, dim, seed + 2) * 20, bits), "down": quantize(weights(dim, inner, seed + 3), bits)}
    g = torch.Generator().manual_seed(seed + 4)
    biases = dict(gate_bias=torch.randn(inner, generator=g), up_bias=torch.randn(inner, generator=g),
                  down_bias=torch.randn(dim, generator=g))
    x = acts(tokens, dim)
    twin = gpt_oss_reference(x, qts["gate"], qts["up"], qts["down"], *biases.values(), alpha=1.702, limit=limit)
    return qts, biases, x, twin


@pytest.mark.parametrize("bits", (2, 4, 8))
@pytest.mark.parametrize("tokens", (1, 5))
def test_gpt_oss_expert_on_each_matmul_matches_its_twin(bits, tokens):
    limit = 1.0   # the weights are scaled so that both clamps cut (checked below)
    qts, biases, x, twin = expert_case(bits, tokens, limit)
    xt = torch.from_numpy(x)
    gate = xt @ dequantize_reference(qts["gate"]).T + biases["gate_bias"]
    assert (gate > limit).any() and ((gate < -limit) | (gate > limit)).float().mean() > 0.05
    run = lambda matmul: gpt_oss_expert(xt, matmul, **biases, alpha=1.702, limit=limit).numpy()
    fused_float = run(lambda h, role: torch.from_numpy(qmatmul(h.contiguous().numpy(), qts[role])))
    dequant = run(dense_matmul({role: dequantize(qt) for role, qt in qts.items()}))
    fused_int = run(lambda h, role: torch.from_numpy(qmatmul_int(h.contiguous().numpy(), qts[role])))
    scale = np.abs(twin).max()
    assert np.abs(fused_float - twin).max() <= 1e-5 * scale
    assert np.abs(dequant - twin).max() <= 1e-5 * scale
    # int8 activations (x and the hidden layer, per group of 32..64): ~1% of the output's scale
    assert np.abs(fused_int - twin).max() <= 3e-2 * scale


@pytest.mark.parametrize("path", int_paths())
@pytest.mark.parametrize("bits", (2, 4, 8))
def test_a_layers_gpt_oss_experts_in_one_kernel_call_match_the_per_matrix_path(bits, path):
    """The layer kernel computes GPT-OSS's clamped SwiGLU with biases: each pair close to the expert on
    qmatmul_int matmuls (which test_gpt_oss_expert_on_each_matmul_matches_its_twin checks against the
    twin; the sigmoid is numba's here, and a last bit can move an int8 code of the hidden layer by one),
    the bits of that expert alone in the call, and a SwiGLU expert beside it unchanged."""
    limit = 1.0
    cases = [expert_case(bits, 3, limit, seed) for seed in (0, 10)]
    x = cases[0][2]
    rows, keep = [], []
    for qts, biases, _, _ in cases:
        arrays = gpt_oss_arrays(**biases, alpha=1.702, limit=limit)
        keep.append(arrays)
        rows.append(gpt_oss_layout(expert_layout(qts["gate"], qts["up"], qts["down"]), arrays))
    pairs, starts = np.concatenate([x, x]), np.array([0, 3, 6])
    together = swiglu_experts_int(pairs, np.stack(rows), starts, path)
    for a, (qts, biases, _, twin) in enumerate(cases):
        got = together[starts[a]:starts[a + 1]]
        alone = swiglu_experts_int(x, rows[a][None], np.array([0, 3]), path)
        assert np.array_equal(got, alone)
        per_matrix = gpt_oss_expert(torch.from_numpy(x), lambda h, role: torch.from_numpy(
            qmatmul_int(h.contiguous().numpy(), qts[role], path=path)), **biases, alpha=1.702, limit=limit).numpy()
        assert np.abs(got - per_matrix).max() <= 1e-4 * np.abs(twin).max()   # measured ~2e-7
    swiglu_row = expert_layout(cases[0][0]["gate"], cases[0][0]["up"], cases[0][0]["down"])
    mixed = swiglu_experts_int(pairs, np.stack([swiglu_row, rows[1]]), starts, path)
    assert np.array_equal(mixed[:3], swiglu_experts_int(x, swiglu_row[None], np.array([0, 3]), path))
    assert np.array_equal(mixed[3:], together[3:])


def test_a_gpt_oss_layout_refuses_arrays_of_the_wrong_shape():
    qts, biases, _, _ = expert_case(4, 1, 1.0)
    row = expert_layout(qts["gate"], qts["up"], qts["down"])
    arrays = gpt_oss_arrays(**{**biases, "up_bias": biases["up_bias"][:-1]}, alpha=1.702, limit=1.0)
    with pytest.raises(ValueError, match=r"up bias: expected float32 \[96\]"):
        gpt_oss_layout(row, arrays)


@pytest.fixture(scope="module")
def checkpoints(tiny_model):
    return {"float": tiny_model("gpt_oss", swiglu_limit=0.5), "mxfp4": tiny_model("gpt_oss", swiglu_limit=0.5, mxfp4=True)}


def dequantized_reference(path, bits):
    """The checkpoint's model (float32) with each expert's matrices replaced by quantize -> dequantize_reference."""
    model = edgemoe.load(path, dtype=torch.float32)
    model.experts = InMemoryExperts({key: DenseExpert(**{role: dequantize_reference(quantize(e.weights[role], bits))
                                                        for role in ("gate", "up", "down")}, activation=e.activation)
                                     for key, e in model.experts.experts.items()})
    return model


@pytest.mark.parametrize("source", ["float", "mxfp4"])
def test_store_runs_on_every_compute_path(checkpoints, tmp_path, source, vram_device):
    convert(checkpoints[source], tmp_path / "s", bits=8)
    reference = dequantized_reference(checkpoints[source], 8)
    ids = torch.tensor(reference.tokenizer.encode(TEXT))
    expected = reference.logits(ids)
    for compute in ("fused-float", "dequant"):
        with edgemoe.load(tmp_path / "s", compute=compute, ram=20_000) as model:
            assert (model.logits(ids) - expected).abs().max() <= 1e-4, compute
    with edgemoe.load(tmp_path / "s", ram=0, vram="1GB", device=vram_device) as model:       # resident on the device
        assert (model.logits(ids) - expected).abs().max() <= 1e-4
        assert set(model.store.resident().values()) == {"vram"}
    with edgemoe.load(tmp_path / "s", compute="device", ram="1GB", vram=1, device=vram_device) as model:  # copied over
        assert (model.logits(ids) - expected).abs().max() <= 1e-4
    with edgemoe.load(tmp_path / "s", compute="fused-int") as model:
        got = model.logits(ids)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl <= 1e-3 and (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    with edgemoe.load(tmp_path / "s", compute="fused-float") as model:
        assert model.generate("To be", max_new_tokens=8, stop_token_ids=[]) == \
            reference.generate("To be", max_new_tokens=8, stop_token_ids=[])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ram", [None, "1B"])
def test_a_gpt_oss_store_computes_a_layers_experts_in_one_kernel_call(checkpoints, tmp_path, ram, dtype, monkeypatch):
    """On "fused-int" a layer's GPT-OSS experts go through one layer-kernel call, every expert
    resident or a cache of one byte (each expert read as it is needed): the same logits bit for bit
    either way, and close to one call per expert on the per-matrix kernels (layer_kernel off)."""
    convert(checkpoints["float"], tmp_path / "s", bits=4)
    calls = []
    kernel = quantized.swiglu_experts_int
    monkeypatch.setattr(quantized, "swiglu_experts_int", lambda *a: calls.append(len(a[1])) or kernel(*a))

    def run(layer_kernel, **options):
        with edgemoe.load(tmp_path / "s", dtype, 1, preload="none", compute="fused-int", **options) as model:
            model.experts.layer_kernel = layer_kernel
            ids = model.tokenizer.encode(TEXT)
            if ram is None:
                for entry in model.store.experts():
                    model.store.get(*entry.key)
            return decode(model, ids), model.logits(ids)

    per_matrix = run(False, **({} if ram is None else {"ram": ram}))
    assert not calls
    by_layer = run(True, **({} if ram is None else {"ram": ram}))
    assert calls and max(calls) > 1
    everything = run(True)
    assert torch.equal(by_layer[0], everything[0]) and torch.equal(by_layer[1], everything[1])
    for got, expected in zip(by_layer, per_matrix):
        assert (got - expected).abs().max() <= 1e-3 * expected.abs().max()


def test_a_4_bit_store_evaluates_close_to_the_checkpoint(checkpoints, tmp_path):
    convert(checkpoints["mxfp4"], tmp_path / "s", bits=4)
    reference = edgemoe.load(checkpoints["mxfp4"])
    ids = torch.tensor(reference.tokenizer.encode(TEXT * 3, add_special_tokens=False))
    with edgemoe.load(tmp_path / "s", compute="fused-float") as model:
        result = evaluate(model, ids, context=32, reference=reference)
    assert result.tokens == len(ids) - 1 and 0 < result.kl < 0.1 and result.top1_agreement >= 0.8
    assert abs(result.perplexity / result.reference_perplexity - 1) < 0.1


def test_manifest_spec_without_the_new_fields_reads_as_swiglu(tiny_model, tmp_path):
    """Stores written before expert_activation existed keep their meaning."""
    convert(tiny_model("mixtral"), tmp_path / "s", bits=4)
    data = json.loads((tmp_path / "s" / MANIFEST).read_text())
    for name in ("expert_activation", "swiglu_alpha", "swiglu_limit", "attention_sinks"):
        data["spec"].pop(name, None)   # a SwiGLU model's manifest now lists no swiglu_* parameters
    (tmp_path / "s" / MANIFEST).write_text(json.dumps(data))
    spec = read_manifest(tmp_path / "s").spec
    assert spec.expert_activation == "swiglu" and not spec.attention.attention_sinks
    assert spec == ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))


def rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("mxfp4,edit,message", [
    (False, lambda t: t.pop("model.layers.1.mlp.experts.gate_up_proj_bias"),
     r"missing tensor model\.layers\.1\.mlp\.experts\.gate_up_proj_bias \(for layers\.1\.expert_gate_up_bias\)"),
    (False, lambda t: t.update({"model.layers.0.mlp.experts.down_proj": t["model.layers.0.mlp.experts.down_proj"][:, :32].clone()}),
     r"tensor model\.layers\.0\.mlp\.experts\.down_proj has shape \(4, 32, 64\), expected \(4, 64, 64\)"),
    (True, lambda t: t.update({"model.layers.0.mlp.experts.down_proj_blocks":
                               t["model.layers.0.mlp.experts.down_proj_blocks"][:, :, :1].contiguous()}),
     r"tensor model\.layers\.0\.mlp\.experts\.down_proj_blocks has shape \(4, 64, 1, 16\), expected \(4, 64, 2, 16\)"),
    (True, lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj_scales":
                               t["model.layers.1.mlp.experts.gate_up_proj_scales"][:3]}),
     r"tensor model\.layers\.1\.mlp\.experts\.gate_up_proj_scales has shape \(3, 128, 2\), expected \(4, 128, 2\)"),
    (True, lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_scales"),
     r"missing model\.layers\.0\.mlp\.experts\.gate_up_proj_scales \(MXFP4 experts\)"),
])
def test_malformed_checkpoints_name_the_tensor(tiny_model, tmp_path, mxfp4, edit, message):
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_model("gpt_oss", mxfp4=mxfp4), path)
    rewrite(path, edit)
    with pytest.raises(CheckpointError, match=message):
        edgemoe.load(path)


def test_a_bfloat16_mxfp4_checkpoint_like_the_released_ones(tiny_model, tmp_path):
    """bfloat16 dense weights and biases, MXFP4 experts: float32 parity with transformers, and a store
    from it runs the experts with their bfloat16 biases."""
    import transformers

    path = tiny_model("gpt_oss", dtype="bfloat16", mxfp4=True, swiglu_limit=0.5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                            experts_implementation="eager").eval()
    ours = edgemoe.load(path, dtype=torch.float32)
    ids = torch.tensor(ours.tokenizer.encode(TEXT))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert (ours.logits(ids) - expected).abs().max() <= 1e-4
    convert(path, tmp_path / "s", bits=8)
    with edgemoe.load(tmp_path / "s", torch.float32, compute="fused-float") as model:
        assert model.layers[0]["expert_gate_up_bias"].shape == (4, 128)
        got = model.logits(ids)
    reference = dequantized_reference(path, 8)
    assert (got - reference.logits(ids)).abs().max() <= 1e-4


def test_attention_sinks_take_their_share_of_each_softmax():
    """A sink of -inf is no sink (SDPA's result); a finite one scales each head's output by
    1 - its softmax share, computed here by hand for a query that sees every key."""
    from edgemoe.layers import attend, attention_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, 8, generator=g), torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    mask = attention_mask(torch.arange(5), 5, window=3)
    plain = attend(q, k, v, mask)
    assert torch.allclose(attend(q, k, v, mask, sinks=torch.full((4,), float("-inf"))), plain, atol=1e-6)
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0])
    got = attend(q[-1:], k, v, None, sinks=sinks).view(4, 8)
    scores = torch.einsum("hd,hld->hl", q[-1], k.repeat_interleave(2, dim=0)) / 8 ** 0.5     # [H, L]
    kept = 1 - torch.sigmoid(sinks - scores.logsumexp(-1))          # exp(s) / (sum exp(scores) + exp(s))
    expected = attend(q[-1:], k, v, None).view(4, 8) * kept[:, None]
    assert torch.allclose(got, expected, atol=1e-6)
