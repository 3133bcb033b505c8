"""edgemoe.quant: pack/unpack round trips, quantize/dequantize_reference, zero-copy arrays, errors."""

import mmap

import numpy as np
import pytest
import torch

from edgemoe.quant import (FORMATS, QuantError, QuantizedTensor, dequantize_reference, get_format,
                           group_layout, narrow, quantize)

WIDTHS = (2, 4, 8)
SHAPES = [(1, 1), (3, 7), (17, 33), (8, 64), (5, 130)]
GROUPS = (None, 8, 16, 24)


def weights(rows, cols, seed=0):
    """Gaussian weights with a few heavy-tailed outliers, like trained experts."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    outliers = torch.rand(rows, cols, generator=g) < 0.01
    return torch.where(outliers, w * 20, w)


def test_quant_is_imported_under_edgemoe():
    import edgemoe.quant

    assert edgemoe.quant.__file__.replace("\\", "/").endswith("/quant/__init__.py")


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("group", (1, 4, 8, 12, 64))
def test_pack_unpack_round_trip(bits, group):
    fmt = get_format(bits)
    group = fmt.padded_group(group)
    codes = torch.randint(0, fmt.qmax + 1, (3, 5, group), dtype=torch.uint8)
    packed = fmt.pack(codes)
    assert packed.shape == (3, 5 * group * bits // 8)
    assert torch.equal(fmt.unpack(packed, group), codes)


def test_planar_layout_int4():
    """Byte k of a group holds column k (low nibble) and column k + G/2 (high nibble)."""
    codes = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8)
    assert FORMATS[4].pack(codes).tolist() == [[0x40, 0x51, 0x62, 0x73]]
    codes2 = torch.tensor([[[1, 2, 3, 0]]], dtype=torch.uint8)
    assert FORMATS[2].pack(codes2).tolist() == [[1 | 2 << 2 | 3 << 4]]


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", GROUPS)
def test_rtn_round_trip_within_half_a_step(bits, shape, group_size):
    w = weights(*shape)
    qt = quantize(w, bits, group_size)
    group, ng = group_layout(bits, group_size, shape[1])
    assert qt.shape == shape and qt.group == group and qt.scale.shape == (shape[0], ng)
    back = dequantize_reference(qt)
    assert back.shape == shape and back.dtype == torch.float32
    step = torch.from_numpy(np.repeat(qt.scale, group, axis=1)[:, : shape[1]])
    assert (back - w).abs().le(step * 0.5 * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("method", ("rtn", "hqq"))
@pytest.mark.parametrize("group_size", (None, 8))
def test_constant_and_zero_rows_are_exact(bits, method, group_size):
    w = weights(6, 19)
    w[1] = 0.0
    w[3] = -1.75
    w[4] = 3e4
    back = dequantize_reference(quantize(w, bits, group_size, method))
    for r in (1, 3, 4):
        assert torch.equal(back[r], w[r]), r


@pytest.mark.parametrize("bits", WIDTHS)
def test_hqq_refines_rtn(bits):
    """HQQ starts from RTN and keeps its best iterate: its error stays at or below RTN's (Lp, p<1)."""
    w = weights(64, 256, seed=1)
    errs = {}
    for method in ("rtn", "hqq"):
        qt = quantize(w, bits, 64, method)
        errs[method] = float(((dequantize_reference(qt) - w).abs() ** 0.7).mean())
        assert np.isfinite(qt.scale).all() and np.isfinite(qt.zero).all()
    assert errs["hqq"] <= errs["rtn"] * 1.001


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float64))
def test_any_float_input_dtype(dtype):
    w = weights(4, 40).to(dtype)
    back = dequantize_reference(quantize(w, 8))
    assert (back - w.float()).abs().max() <= float(w.float().abs().max()) / 100


def test_arrays_and_nbytes():
    qt = quantize(weights(10, 33), 4, 16)
    arrays = qt.arrays()
    assert set(arrays) == {"packed", "scale", "zero"}
    assert all(a.ndim == 1 for a in arrays.values())
    assert qt.nbytes == sum(a.nbytes for a in arrays.values()) == 10 * 3 * 8 + 2 * 10 * 3 * 4
    assert arrays["scale"].dtype == np.float32 and arrays["packed"].dtype == np.uint8


def test_from_arrays_is_zero_copy_on_a_readonly_mmap(tmp_path):
    qt = quantize(weights(9, 50), 2, 16)
    path = tmp_path / "blob"
    offsets, blob = {}, b""
    for name, a in qt.arrays().items():
        offsets[name] = (len(blob), a.dtype, a.size)
        blob += a.tobytes() + b"\0" * (-len(a.tobytes()) % 64)
    path.write_bytes(blob)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        views = {n: np.frombuffer(mm, dtype=dt, count=size, offset=off) for n, (off, dt, size) in offsets.items()}
        rebuilt = QuantizedTensor.from_arrays(2, 16, (9, 50), views)
        for name, view in views.items():
            assert np.shares_memory(getattr(rebuilt, name), view)
            assert not getattr(rebuilt, name).flags.writeable
        assert torch.equal(dequantize_reference(rebuilt), dequantize_reference(qt))


@pytest.mark.parametrize("call, needle", [
    (lambda: quantize(weights(2, 8), 3), "bits=3"),
    (lambda: quantize(weights(2, 8), 4.0), "bits=4.0"),
    (lambda: quantize(weights(2, 8), True), "bits=True"),
    (lambda: quantize(weights(2, 8), 4, 0), "group_size=0"),
    (lambda: quantize(weights(2, 8), 2, 6), "group_size=6"),
    (lambda: quantize(weights(2, 8), 4, method="gptq"), "method='gptq'"),
    (lambda: quantize(torch.ones(8), 4), "w:"),
    (lambda: quantize(torch.ones(2, 8, dtype=torch.int32), 4), "w:"),
    (lambda: quantize(torch.tensor([[1.0, float("nan")]]), 4), "non-finite"),
    (lambda: quantize(torch.tensor([[1.0, float("inf")]]), 8), "non-finite"),
    (lambda: QuantizedTensor.from_arrays(4, None, (2, 8), {"packed": np.zeros(8, np.uint8)}), "missing"),
    (lambda: QuantizedTensor.from_arrays(4, None, (2, 8), {"packed": np.zeros(8, np.uint8),
                                                            "scale": np.zeros(2, np.float16),
                                                            "zero": np.zeros(2, np.float32)}), "scale:"),
    (lambda: QuantizedTensor.from_arrays(4, None, (2, 8), {"packed": np.zeros(7, np.uint8),
                                                            "scale": np.zeros(2, np.float32),
                                                            "zero": np.zeros(2, np.float32)}), "packed:"),
    (lambda: QuantizedTensor.from_arrays(4, None, (0, 8), {}), "missing"),
    (lambda: QuantizedTensor.from_arrays(4, None, (0, 8), {"packed": np.zeros(0, np.uint8),
                                                            "scale": np.zeros(0, np.float32),
                                                            "zero": np.zeros(0, np.float32)}), "shape="),
])
def test_invalid_input_names_the_argument(call, needle):
    with pytest.raises(QuantError) as info:
        call()
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def _bucket_middles(w: torch.Tensor, bits: int, narrow_bits: int, group_size) -> torch.Tensor:
    """The plain-torch reading of a narrowed copy: each code q of w's quantization replaced by the
    middle of its bucket, (floor(q / 2^s) * 2^s + (2^s - 1) / 2 - zero) * scale, s = bits - narrow_bits."""
    qt = quantize(w, bits, group_size)
    scale, zero = torch.tensor(qt.scale), torch.tensor(qt.zero)
    rows, cols = w.shape
    g = qt.group
    pad = scale.shape[1] * g - cols
    wg = torch.cat([w, w[:, -1:].expand(rows, pad)], 1).reshape(rows, -1, g)
    codes = torch.round(wg / scale[..., None] + zero[..., None]).clamp(0, (1 << bits) - 1)
    step = 1 << (bits - narrow_bits)
    middle = torch.div(codes, step, rounding_mode="floor") * step + (step - 1) / 2
    return ((middle - zero[..., None]) * scale[..., None]).reshape(rows, -1)[:, :cols]


@pytest.mark.parametrize("bits, narrow_bits", [(4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("shape, group_size", [((17, 33), None), ((5, 130), 16), ((8, 64), 8)])
def test_narrow_reads_back_the_middle_of_each_code_bucket(bits, narrow_bits, shape, group_size):
    w = weights(*shape, seed=3)
    qt = narrow(quantize(w, bits, group_size), narrow_bits)
    assert (qt.bits, qt.group_size, qt.shape) == (narrow_bits, group_size, shape)
    torch.testing.assert_close(dequantize_reference(qt), _bucket_middles(w, bits, narrow_bits, group_size),
                               rtol=1e-5, atol=1e-6)


def test_narrow_keeps_constant_groups_exact():
    w = torch.full((3, 40), 0.25)
    w[1] = -1.5
    w[2, :20] = torch.linspace(-1, 1, 20)
    back = dequantize_reference(narrow(quantize(w, 4, 20), 2))
    torch.testing.assert_close(back[:2], w[:2])
    torch.testing.assert_close(back[2, 20:], w[2, 20:])


def test_narrowed_int4_is_closer_to_the_weights_than_min_max_int2():
    w = weights(64, 256, seed=5)
    error = lambda qt: float((dequantize_reference(qt) - w).norm() / w.norm())
    assert error(narrow(quantize(w, 4), 2)) < error(quantize(w, 2))


def test_narrow_refuses_a_width_not_below_the_tensors():
    with pytest.raises(QuantError, match="bits=4"):
        narrow(quantize(weights(4, 8), 4), 4)
