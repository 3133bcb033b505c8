"""KV cache elements inside numba kernels: float32, or bfloat16 held as int16 bit patterns.

numba has no 16-bit float type, so a bfloat16 cache reaches a kernel as an int16 array over the
same memory (edgemoe.kv_cache.KVCache.layer_arrays). `widen(e)` gives a cache element as float32 and
`narrow(x, e)` gives float32 x in the element type of e; the kernels call them for every cache read
and write, and numba compiles one version per cache type.

bfloat16 is float32's upper 16 bits: widening shifts them back, exactly. Narrowing rounds to nearest,
ties to even, as torch's float32 -> bfloat16 conversion does for finite values, so a cache written
by a kernel and one written by torch hold the same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def _float32_from_bits(typingctx, bits):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_from_float32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


def widen(e):
    """A cache element as float32 (compiled only: see the overload)."""
    raise NotImplementedError("edgemoe.kernels.kv.widen runs inside numba kernels only")


def narrow(x, like):
    """float32 x as an element of like's type (compiled only: see the overload)."""
    raise NotImplementedError("edgemoe.kernels.kv.narrow runs inside numba kernels only")


@overload(widen, inline="always")
def _widen(e):
    if isinstance(e, types.Float):
        return lambda e: np.float32(e)
    if e == types.int16:
        return lambda e: _float32_from_bits(np.uint32(np.uint16(e)) << np.uint32(16))
    return None


@overload(narrow, inline="always")
def _narrow(x, like):
    if isinstance(like, types.Float):
        return lambda x, like: np.float32(x)
    if like == types.int16:
        def to_bfloat16(x, like):
            bits = _bits_from_float32(np.float32(x))
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            return np.int16(np.uint16(rounded))
        return to_bfloat16
    return None
