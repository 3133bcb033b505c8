"""The decode engine's attention over the KV cache (edgemoe/kernels/cpu_layer.py's _attend_group and its
exp) against float64 numpy: every head count of a group, cache lengths around its four-position
steps, a sliding window's start, sinks, and both cache element types."""

import numba
import numpy as np
import pytest

from edgemoe.kernels._jit import SERIAL
from edgemoe.kernels.cpu_layer import _attend_group, exp_nonpositive


@numba.njit(**SERIAL)   # the flags of the softmax that inlines it
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = exp_nonpositive(x[i])


def test_exp_nonpositive_is_within_2_5e_7_of_exp_relative_and_flushes_below_the_normal_range():
    x = np.concatenate([np.linspace(-100, 0, 400_001), -np.logspace(-8, 1, 10_001), [0.0, -87.33, -87.3]])
    x = x.astype(np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    exact = np.exp(x.astype(np.float64))
    normal = x >= np.float32(-87.33)
    assert np.all(np.abs(got[normal] - exact[normal]) <= 2.5e-7 * exact[normal])
    assert np.all(got[~normal] == 0)
    assert got[x == 0][0] == 1.0


def _bfloat16_bits(a):
    """a float32 -> the int16 bit patterns of a bfloat16 cache (truncated: values exact in both)."""
    return (a.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)


def _reference(q, keys, values, j0, j1, scale, sinks):
    """float64 softmax(q . k * scale) @ v per head over positions [j0, j1), a sink logit per head."""
    q, k, v = (a.astype(np.float64) for a in (q, keys[j0:j1], values[j0:j1]))
    logits = q @ k.T * scale
    if sinks is not None:
        logits = np.concatenate([logits, sinks.astype(np.float64)[:, None]], axis=1)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return p[:, :j1 - j0] @ v


@pytest.mark.parametrize("cache_type", ["float32", "bfloat16"])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("group, j0, j1", [(1, 0, 1), (4, 0, 3), (4, 0, 4), (2, 0, 5), (4, 7, 9), (3, 5, 138),
                                           (4, 0, 513)])
def test_a_kv_head_group_attends_as_float64_does(group, j0, j1, sinks, cache_type):
    rng = np.random.default_rng(j1 * 10 + group)
    dk, dv, length = 64, 48, 520
    q = rng.standard_normal((group, dk)).astype(np.float32)
    keys = rng.standard_normal((length, dk)).astype(np.float32)
    values = rng.standard_normal((length, dv)).astype(np.float32)
    if cache_type == "bfloat16":   # the kernel reads the bit patterns; the reference their float32 values
        keys, values = (_bfloat16_bits(a) for a in (keys, values))
        exact_keys, exact_values = ((a.astype(np.uint16).astype(np.uint32) << 16).view(np.float32) for a in (keys, values))
    else:
        exact_keys, exact_values = keys, values
    sink = rng.standard_normal(group).astype(np.float32) * 3 if sinks else np.zeros(group, np.float32)
    scale = np.float32(dk ** -0.5)
    scores = np.empty((group, j1 - j0), np.float32)
    out = np.full((group, dv), np.nan, np.float32)
    _attend_group(q, keys, values, j0, j1, scale, sink, sinks, scores, out)
    expected = _reference(q, exact_keys, exact_values, j0, j1, scale, sink if sinks else None)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)
