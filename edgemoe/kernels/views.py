"""numpy arrays over raw addresses inside numba kernels: how one kernel call reaches many experts.

A layer's active experts live in separate read buffers (one per expert, edgemoe.store). numba
cannot take a Python list of arrays cheaply (a typed List costs microseconds per element to
build), so the caller passes each array's address in an int64 table and the kernel views them
with `numba.carray`. The caller must keep the arrays alive for the duration of the call (it holds
the objects that own them); the views own nothing.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload


def _pointer_from(dtype):
    @intrinsic
    def pointer(typingctx, address):
        ptr = types.CPointer(dtype)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(types.int64), codegen

    return pointer


_uint8_pointer = _pointer_from(types.uint8)
_float32_pointer = _pointer_from(types.float32)


@numba.njit(cache=True, nogil=True)
def uint8_view(address, n):
    """uint8 [n] over the bytes at address."""
    return numba.carray(_uint8_pointer(address), n)


@numba.njit(cache=True, nogil=True)
def float32_view(address, rows, cols):
    """float32 [rows, cols], C order, at address."""
    return numba.carray(_float32_pointer(address), (rows, cols))


def like_view(address, shape, like):
    """An array of like's element type and `shape` (a tuple), C order, at address (compiled only:
    see the overload). How a kernel views per-layer buffers whose element type varies by caller
    (a KV cache of float32, or of bfloat16 as int16 bit patterns)."""
    raise NotImplementedError("edgemoe.kernels.views.like_view runs inside numba kernels only")


@overload(like_view, inline="always")
def _like_view(address, shape, like):
    pointer = _pointer_from(like.dtype)
    return lambda address, shape, like: numba.carray(pointer(address), shape)


def address(a: np.ndarray) -> int:
    """The address of a C-contiguous array's first element."""
    assert a.flags.c_contiguous
    return a.__array_interface__["data"][0]
