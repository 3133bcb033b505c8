"""The integer path (edgemoe/kernels/cpu_int.py): bit-exact with its torch twin on every path the CPU can
run, within the int8 rounding bound of the float result, independent of threads and batching.

Bound (qmatmul_int vs the exact float product with the same dequantized weight W). Per token t and
group g the activations are xq * xs with |x - xq * xs| <= xs / 2 (rounding to nearest; the division
x / xs itself is off by at most 127 * 2^-24 of xs), and the integer sums are exact, so

    |y_int[t, r] - y[t, r]| <= sum_g (xs[t, g] / 2) * (1 + 1e-4) * sum_{k in g} |W[r, k]|  +  float rounding,

the float rounding being that of the float32 epilogue and of the float32 twin, held to
2e-7 * (|x| @ M^T) as tests/test_kernels.py does (M: scale * (code + |zero|)). The worst case has
every rounding error of a row aligned; measured errors are 6-20x below it (relative to max|y|:
0.5-1.1% for qmatmul_int, 0.5-1.2% for swiglu_expert_int, on these random weights).
swiglu_expert_int: the same bound carried through silu(g) * u (|silu'| <= 1.1) and through the
re-quantization of h, computed below from the exact float intermediate.
"""

import ctypes
import mmap
import os

import llvmlite.binding as llvm
import numpy as np
import pytest
import torch

from edgemoe.kernels import int_paths, qmatmul_int, set_threads, swiglu_expert_int
from edgemoe.kernels import ops
from edgemoe.kernels.reference import (qmatmul_int_twin, qmatmul_reference, quantize_activations_reference,
                                       swiglu_int_twin, swiglu_reference)
from edgemoe.quant import QuantizedTensor, dequantize_reference, quantize

from helpers import acts, code_magnitude, weights

WIDTHS = (2, 4, 8)
PATHS = int_paths()
SILU_SLOPE = 1.1  # max |d silu / dx| = 1.0998
PROT_NONE = 0     # mprotect's "no access" (Python's mmap module does not name it)


def int_rounding_bound(x: np.ndarray, qt) -> np.ndarray:
    """[T, R]: the bound of the module docstring for qmatmul_int(x, qt)."""
    _, xs, _ = quantize_activations_reference(torch.from_numpy(x), qt.group, qt.ngroups)  # [T, NG]
    w = dequantize_reference(qt).abs().double()
    w = torch.nn.functional.pad(w, (0, qt.ngroups * qt.group - qt.shape[1])).reshape(qt.shape[0], qt.ngroups, -1)
    act = (xs.double() / 2 * (1 + 1e-4)) @ w.sum(-1).T
    return act.numpy() + 2e-7 * (np.abs(x).astype(np.float64) @ code_magnitude(qt).T)


def test_this_cpu_offers_its_paths():
    features = llvm.get_host_cpu_features()
    assert PATHS[-1] == "portable"
    assert ("avx2" in PATHS) == bool(features.get("avx2"))
    assert ("avx512vnni" in PATHS) == bool(features.get("avx512vnni") and features.get("avx512bw")
                                           and features.get("avx2"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group_size", (None, 32, 24, 128, 256))
@pytest.mark.parametrize("tokens", (1, 5))
def test_qmatmul_int_is_bit_exact_with_its_twin_and_within_the_rounding_bound(path, bits, group_size, tokens):
    """Groups of 128 and 256 (and 32 at INT8) take the lane rule, the others the per-group sums; a
    padded last group either way."""
    qt = quantize(weights(37, 2600), bits, group_size)  # planes of 2600 / n codes: a partial last block
    x = acts(tokens, 2600)
    y = qmatmul_int(x, qt, path)
    assert y.dtype == np.float32 and y.shape == (tokens, 37)
    assert np.array_equal(y, qmatmul_int_twin(x, qt))
    assert (np.abs(y - qmatmul_reference(x, qt)) <= int_rounding_bound(x, qt)).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (19, 33), (5, 100), (4, 4096)])
def test_qmatmul_int_odd_shapes_zero_rows_and_zero_tokens(path, bits, shape):
    w = weights(*shape)
    w[0] = 0.0
    w[-1] = 0.5
    qt = quantize(w, bits, 32 if shape[1] == 100 else None)
    x = acts(3, shape[1])
    x[1] = 0.0  # an all-zero token: scale 0, codes 0
    y = qmatmul_int(x, qt, path)
    assert np.array_equal(y, qmatmul_int_twin(x, qt)) and (y[1] == 0).all()
    assert (np.abs(y - qmatmul_reference(x, qt)) <= int_rounding_bound(x, qt)).all()


def test_int8_codes_at_the_extremes_do_not_saturate():
    """Codes 255 against activations +-127 in every column: what vpmaddubsw would saturate on."""
    w = torch.where(torch.arange(64 * 96).reshape(64, 96) % 3 == 0, 1.0, -1.0)
    qt = quantize(w, 8)
    x = np.where(np.arange(2 * 96).reshape(2, 96) % 2 == 0, 1.0, -1.0).astype(np.float32)
    for path in PATHS:
        y = qmatmul_int(x, qt, path)
        assert np.array_equal(y, qmatmul_int_twin(x, qt))
        assert np.allclose(y, qmatmul_reference(x, qt), rtol=1e-5, atol=1e-4)  # exact activations here


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("cols, group_size", [(1000, 64), (2 * 232, None), (4 * 232, None), (232, None),
                                              (1024, 128), (1024, 512), (1024, None), (384, None), (320, None),
                                              (352, None), (2880, None), (40, None)])
def test_paths_agree_bit_for_bit(bits, cols, group_size):
    """Planes of 232 bytes: three 64-byte VNNI blocks, one 32-byte AVX2 block, 8 bytes on the portable
    loop; lane-rule groups of one, two and several blocks. Ungrouped rows go in batches of 16 rows
    (VNNI) or 8 (AVX2), the last of 50 rows partial, and 9 tokens as two tiles of 4 and one alone:
    rows of whole blocks (1024, 384 and 320 columns: whole 64-byte blocks, or whole 32-byte ones only
    at INT4's 160 bytes), and rows with bytes past them (352 and 2880 columns, the expert widths of the
    DeepSeek-V2-shaped bench checkpoint and of GPT-OSS; 40 columns: no whole block at all). Each token
    gives the same bits alone."""
    qt = quantize(weights(50, cols), bits, group_size)
    x = acts(9, cols)
    results = [qmatmul_int(x, qt, p) for p in PATHS]
    assert all(np.array_equal(results[0], r) for r in results)
    assert np.array_equal(results[0], qmatmul_int_twin(x, qt))
    alone = np.concatenate([qmatmul_int(x[t:t + 1].copy(), qt, PATHS[0]) for t in range(len(x))])
    assert np.array_equal(alone, results[0])


@pytest.fixture
def guarded_page():
    """A writable page followed by one the process may not read (mprotect PROT_NONE): a read past the
    first page's end crashes the process instead of passing unseen. Linux and macOS (libc's mmap)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    page = mmap.PAGESIZE
    address = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    assert libc.mprotect(address + page, page, PROT_NONE) == 0, os.strerror(ctypes.get_errno())
    yield np.ctypeslib.as_array((ctypes.c_uint8 * page).from_address(address))
    libc.munmap(address, 2 * page)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", WIDTHS)
def test_a_rows_last_bytes_are_read_no_further_than_its_matrix(path, bits, guarded_page):
    """A 352-column matrix's codes end where the readable memory ends: its rows' last bytes (past
    their last whole block: a masked block on VNNI) are read, and nothing past them."""
    qt = quantize(weights(9, 352), bits)
    at_end = guarded_page[guarded_page.size - qt.packed.size:].reshape(qt.packed.shape)
    at_end[:] = qt.packed
    guarded = QuantizedTensor(qt.bits, qt.group_size, qt.shape, at_end, qt.scale, qt.zero)
    x = acts(5, 352)
    assert np.array_equal(qmatmul_int(x, guarded, path), qmatmul_int_twin(x, qt))


def swiglu_rounding_bound(x, gate, up, down):
    """[T, D]: the qmatmul bound carried through silu(g) * u and the re-quantization of h."""
    g, u = qmatmul_reference(x, gate).astype(np.float64), qmatmul_reference(x, up).astype(np.float64)
    bg, bu = int_rounding_bound(x, gate), int_rounding_bound(x, up)
    silu = g / (1 + np.exp(-g))
    h = silu * u
    bh = SILU_SLOPE * bg * (np.abs(u) + bu) + np.abs(silu) * bu  # |h_int - h| before its quantization
    hmax = np.abs(np.pad(h, ((0, 0), (0, down.ngroups * down.group - h.shape[1])))
                  ).reshape(h.shape[0], down.ngroups, -1).max(-1) + bh.max(-1, keepdims=True)
    wdown = dequantize_reference(down).abs().double()
    wdown = torch.nn.functional.pad(wdown, (0, down.ngroups * down.group - down.shape[1]))
    per_group = wdown.reshape(down.shape[0], down.ngroups, -1).sum(-1).numpy()  # [D, NG]
    requant = (hmax / 127 / 2 * (1 + 1e-4)) @ per_group.T
    return bh @ wdown[:, : down.shape[1]].numpy().T + requant + 1e-5 * np.abs(h @ wdown[:, : down.shape[1]].numpy().T).max()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits, down_bits", [(2, 2), (4, 4), (8, 8), (2, 8)])
@pytest.mark.parametrize("tokens", (1, 3))
def test_swiglu_expert_int_is_bit_exact_with_its_twin_and_within_the_bound(path, bits, down_bits, tokens):
    dim, inner = 40, 90
    gate = quantize(weights(inner, dim, 1), bits)
    up = quantize(weights(inner, dim, 2), bits)
    down = quantize(weights(dim, inner, 3), down_bits, 32)  # 90 columns: padded last group
    x = acts(tokens, dim) * 4
    y = swiglu_expert_int(x, gate, up, down, path)
    assert y.shape == (tokens, dim) and y.dtype == np.float32
    assert np.array_equal(y, swiglu_int_twin(x, gate, up, down))
    assert (np.abs(y - swiglu_reference(x, gate, up, down)) <= swiglu_rounding_bound(x, gate, up, down)).all()


@pytest.mark.parametrize("bits", WIDTHS)
def test_results_do_not_depend_on_threads_nor_on_the_batch(bits):
    qt = quantize(weights(300, 700), bits, 64)
    gate, up, down = quantize(weights(96, 64, 1), bits), quantize(weights(96, 64, 2), bits), quantize(weights(64, 96, 3), bits)
    x, xe = acts(9, 700), acts(5, 64)
    try:
        set_threads(1)
        one = qmatmul_int(x, qt), swiglu_expert_int(xe, gate, up, down)
        set_threads(2)
        two = qmatmul_int(x, qt), swiglu_expert_int(xe, gate, up, down)
    finally:
        set_threads()
    assert all(np.array_equal(a, b) for a, b in zip(one, two))
    alone = np.concatenate([qmatmul_int(x[t:t + 1].copy(), qt) for t in range(9)])
    assert np.array_equal(alone, two[0])


def test_environment_variable_forces_a_path(monkeypatch):
    qt = quantize(weights(8, 64), 4)
    monkeypatch.setenv(ops.INT_PATH_ENV, "portable")
    assert ops.default_int_path() == "portable"
    assert np.array_equal(qmatmul_int(acts(1, 64), qt), qmatmul_int(acts(1, 64), qt, "portable"))
    monkeypatch.setenv(ops.INT_PATH_ENV, "neon")
    with pytest.raises(ValueError, match=r"\$EDGEMOE_INT_PATH='neon'"):
        qmatmul_int(acts(1, 64), qt)


@pytest.mark.parametrize("call, needle", [
    (lambda qt: qmatmul_int(acts(2, 16), qt, "vnni"), "path='vnni'"),
    (lambda qt: qmatmul_int(acts(2, 15), qt), "x:"),
    (lambda qt: qmatmul_int(acts(2, 16), qt.packed), "qt:"),
    (lambda qt: qmatmul_int(acts(1, 70000), quantize(torch.zeros(1, 70000), 8)), "int32"),
    (lambda qt: swiglu_expert_int(acts(1, 16), qt, quantize(weights(16, 16), 8), qt), "up:"),
])
def test_invalid_input_names_the_argument(call, needle):
    qt = quantize(weights(16, 16), 4)
    with pytest.raises(ValueError) as info:
        call(qt)
    assert needle in str(info.value)


def layer_of_experts(dim=64, inner=90):
    """Four experts of one layer at mixed widths and groups, as a budget store mixes them."""
    kinds = [(4, None, 4, None), (2, None, 8, 32), (8, 32, 2, None), (4, 16, 4, 32)]
    return [(quantize(weights(inner, dim, 10 * i + 1), gb, gg), quantize(weights(inner, dim, 10 * i + 2), gb, gg),
             quantize(weights(dim, inner, 10 * i + 3), db, dg)) for i, (gb, gg, db, dg) in enumerate(kinds)]


@pytest.mark.parametrize("path", PATHS)
def test_swiglu_experts_int_is_each_expert_bit_for_bit(path):
    experts = layer_of_experts()
    x = acts(5, 64) * 4
    tokens = [[0, 2], [1], [0, 1, 3, 4], [4]]   # the pairs of each expert, grouped by expert
    starts = np.cumsum([0] + [len(t) for t in tokens]).astype(np.int64)
    layouts = np.stack([ops.expert_layout(*e) for e in experts])
    y = ops.swiglu_experts_int(np.concatenate([x[t] for t in tokens]), layouts, starts, path)
    alone = np.concatenate([swiglu_expert_int(x[t], *e, path=path) for t, e in zip(tokens, experts)])
    assert np.array_equal(y, alone)
    assert np.array_equal(y, np.concatenate([swiglu_int_twin(x[t], *e) for t, e in zip(tokens, experts)]))


@pytest.mark.parametrize("path", PATHS)
def test_a_relu_experts_row_gives_the_per_matrix_paths_bits(path):
    """An ungated relu expert (Switch Transformers; expert_layout without a gate) in the layer kernel,
    beside SwiGLU experts in one call: each pair's row equals up's integer product, torch's relu,
    then down's integer product (the per-matrix path relu experts took before), bit for bit."""
    experts = layer_of_experts()
    relu = [(None, up, down) for _, up, down in experts[:2]]
    x = acts(5, 64) * 4
    tokens = [[0, 2, 3], [1], [0, 1, 3, 4], [4]]
    rows = relu + experts[2:]
    starts = np.cumsum([0] + [len(t) for t in tokens]).astype(np.int64)
    layouts = np.stack([ops.expert_layout(*e) for e in rows])
    y = ops.swiglu_experts_int(np.concatenate([x[t] for t in tokens]), layouts, starts, path)

    def per_matrix(xt, up, down):
        hidden = torch.relu(torch.from_numpy(qmatmul_int(xt, up, path=path))).numpy()
        return qmatmul_int(hidden, down, path=path)
    expected = [per_matrix(x[t], up, down) for t, (_, up, down) in zip(tokens[:2], relu)]
    expected += [swiglu_expert_int(x[t], *e, path=path) for t, e in zip(tokens[2:], experts[2:])]
    assert np.array_equal(y, np.concatenate(expected))
    kinds = [ops.cpu_int.KIND_RELU] * 2 + [ops.cpu_int.KIND_SWIGLU] * 2
    assert (layouts[:2, :3] == 0).all() and list(layouts[:, ops.cpu_int.KIND]) == kinds


def test_swiglu_experts_int_does_not_depend_on_threads():
    experts = layer_of_experts()
    x = acts(4, 64)
    layouts, starts = np.stack([ops.expert_layout(*e) for e in experts]), np.arange(5, dtype=np.int64)
    try:
        set_threads(1)
        one = ops.swiglu_experts_int(x, layouts, starts)
    finally:
        set_threads()
    assert np.array_equal(one, ops.swiglu_experts_int(x, layouts, starts))


@pytest.mark.parametrize("change, needle", [
    (lambda x, layouts, starts: (x, layouts, starts[:-1]), "starts:"),
    (lambda x, layouts, starts: (x, layouts, starts[::-1].copy()), "starts:"),
    (lambda x, layouts, starts: (x[:, :10].copy(), layouts, starts), "x:"),
    (lambda x, layouts, starts: (x, np.stack([layouts[0], ops.expert_layout(*layer_of_experts(inner=30)[0])]),
                                 starts[:3]), "share their shape"),
])
def test_swiglu_experts_int_refuses_inconsistent_arguments(change, needle):
    experts = layer_of_experts()
    args = acts(4, 64), np.stack([ops.expert_layout(*e) for e in experts]), np.arange(5, dtype=np.int64)
    with pytest.raises(ValueError, match=needle):
        ops.swiglu_experts_int(*change(*args))
