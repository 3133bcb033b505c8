"""edgemoe.kernels: parity of every numba kernel with its plain torch twin, determinism, errors.

Tolerances (float32 kernels vs float32 torch twins on the same dequantized weights):
- qmatmul: |y - y_twin| <= TOL[bits] * (|x| @ M^T) elementwise, M[r, c] = scale * (code + |zero|):
  the kernel factors the zero point out of each group, y = s * (x . q - z * sum x), so its rounding
  error scales with the codes and the zero, not with the (smaller) dequantized weight. Measured
  worst ratio on these tests: 1.7e-8 (2 bits), 1.4e-8 (4), 1.6e-8 (8); TOL leaves a 10x margin.
- dequantize: bit-identical (float32 and bfloat16), tolerance 0.
- swiglu_expert: |y - y_twin| <= 1e-5 * max |y_twin| (measured <= 4e-7 relative).
Exact reproducibility (no tolerance): qmatmul gives the same bits whatever the thread count. A token
alone and in a batch take different loops (one token decodes inline, several share a decoded scratch),
whose vector reduction shapes LLVM picks per CPU: equal bits on the AVX-512 Xeon, not on AVX2 (Zen 3),
so that comparison is held to the rounding bound of the parity tests.
"""

import mmap

import numpy as np
import pytest
import torch

from edgemoe.kernels import dequantize, qmatmul, set_threads, swiglu_expert
from edgemoe.kernels.reference import dequantize_twin, qmatmul_reference, swiglu_reference
from edgemoe.quant import QuantizedTensor, quantize

from helpers import acts, code_magnitude, weights

WIDTHS = (2, 4, 8)
TOL = {2: 2e-7, 4: 2e-7, 8: 2e-7}


def assert_qmatmul_close(x, qt):
    y, twin = qmatmul(x, qt), qmatmul_reference(x, qt)
    bound = np.abs(x).astype(np.float64) @ code_magnitude(qt).T
    assert y.shape == twin.shape == (x.shape[0], qt.shape[0]) and y.dtype == np.float32
    excess = np.abs(y - twin) - TOL[qt.bits] * bound
    assert excess.max() <= 0, f"{qt.bits} bits: worst excess {excess.max()}"


def test_kernels_are_imported_under_edgemoe():
    import edgemoe.kernels

    assert edgemoe.kernels.__file__.replace("\\", "/").endswith("/kernels/__init__.py")


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group_size", (None, 32, 24))
@pytest.mark.parametrize("tokens", (1, 2, 5, 16))
def test_qmatmul_parity(bits, group_size, tokens):
    qt = quantize(weights(37, 2600), bits, group_size)  # 2600 columns: several scratch chunks at 8 bits
    assert_qmatmul_close(acts(tokens, 2600), qt)


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (19, 33)])
def test_qmatmul_odd_shapes_and_special_rows(bits, shape):
    w = weights(*shape)
    w[0] = 0.0
    w[-1] = 0.5
    qt = quantize(w, bits)
    for tokens in (1, 3):
        assert_qmatmul_close(acts(tokens, shape[1]), qt)


@pytest.mark.parametrize("bits", WIDTHS)
def test_qmatmul_catches_a_wrong_weight(bits):
    """The parity bound is tight enough to see one code off by one step."""
    qt = quantize(weights(8, 64), bits)
    packed = qt.packed.copy()
    packed[3, 5] ^= 1
    broken = QuantizedTensor(bits, None, qt.shape, packed, qt.scale, qt.zero)
    x = acts(2, 64)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(qmatmul(x, broken), qmatmul_reference(x, qt), rtol=TOL[bits], atol=0)


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group_size", (None, 16))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_dequantize_is_bit_identical_to_twin(bits, group_size, dtype):
    qt = quantize(weights(21, 75), bits, group_size)
    out = dequantize(qt, dtype)
    assert out.dtype == dtype and out.shape == (21, 75)
    assert torch.equal(out, dequantize_twin(qt, dtype))


@pytest.mark.parametrize("bits, down_bits", [(2, 2), (4, 4), (8, 8), (2, 8)])
@pytest.mark.parametrize("tokens", (1, 3, 16))
def test_swiglu_expert_parity(bits, down_bits, tokens):
    dim, inner = 40, 90
    gate = quantize(weights(inner, dim, 1), bits)
    up = quantize(weights(inner, dim, 2), bits)
    down = quantize(weights(dim, inner, 3), down_bits, 32)  # 90 columns: padded last group
    x = acts(tokens, dim)
    y, twin = swiglu_expert(x, gate, up, down), swiglu_reference(x, gate, up, down)
    assert y.shape == (tokens, dim) and y.dtype == np.float32
    assert np.abs(y - twin).max() <= 1e-5 * np.abs(twin).max()


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group_size", (None, 64))
def test_results_do_not_depend_on_threads_and_batches_only_round(bits, group_size):
    """Bit-identical with 1 or 2 threads; a token alone, in a pair, or in a batch of 9 (4 + 4 + 1)
    within the kernel's rounding bound (the loops differ: see the module docstring)."""
    qt = quantize(weights(300, 700), bits, group_size)
    x = acts(9, 700)
    try:
        set_threads(1)
        one = qmatmul(x, qt)
        set_threads(2)
        two = qmatmul(x, qt)
    finally:
        set_threads()
    assert np.array_equal(one, two)
    bound = TOL[bits] * (np.abs(x).astype(np.float64) @ code_magnitude(qt).T)
    alone = np.concatenate([qmatmul(x[t:t + 1].copy(), qt) for t in range(9)])
    assert (np.abs(alone - two) <= bound).all()
    assert (np.abs(qmatmul(x[2:4].copy(), qt) - two[2:4]) <= bound[2:4]).all()


def test_kernels_read_a_readonly_mmap(tmp_path):
    qt = quantize(weights(12, 40), 4, 8)
    path = tmp_path / "blob"
    arrays = qt.arrays()
    path.write_bytes(b"".join(a.tobytes() for a in arrays.values()))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    views, off = {}, 0
    for name, a in arrays.items():
        views[name] = np.frombuffer(mm, dtype=a.dtype, count=a.size, offset=off)
        off += a.nbytes
    mapped = QuantizedTensor.from_arrays(4, 8, (12, 40), views)
    x = acts(2, 40)
    assert np.array_equal(qmatmul(x, mapped), qmatmul(x, qt))
    assert torch.equal(dequantize(mapped), dequantize(qt))


@pytest.mark.parametrize("call, needle", [
    (lambda qt: qmatmul(acts(2, 16).astype(np.float64), qt), "x:"),
    (lambda qt: qmatmul(acts(2, 15), qt), "x:"),
    (lambda qt: qmatmul(np.asfortranarray(acts(3, 16)), qt), "x:"),
    (lambda qt: qmatmul(torch.zeros(2, 16), qt), "x:"),
    (lambda qt: qmatmul(acts(2, 16), qt.packed), "qt:"),
    (lambda qt: dequantize(qt, torch.float16), "dtype="),
    (lambda qt: swiglu_expert(acts(1, 16), *[quantize(weights(24, 16), 4)] * 3), "down"),
    (lambda qt: swiglu_expert(acts(1, 16), qt, quantize(weights(16, 16), 8), qt), "up:"),
    (lambda qt: set_threads(0), "n=0"),
])
def test_invalid_input_names_the_argument(call, needle):
    qt = quantize(weights(16, 16), 4)
    with pytest.raises(ValueError) as info:
        call(qt)
    assert needle in str(info.value)
