"""Packed layouts of the integer codes, one registered format per bit width.

Shapes: R rows (output channels), C columns (input dim), NG groups per row, G padded group size
(columns per group, a multiple of the codes per byte), B = G * bits / 8 bytes per group.

Layout ("planar", the same rule for every width). A row is NG groups stored one after the other,
B bytes each: packed [R, NG * B] uint8, C-contiguous. Inside a group of G codes, with n = 8 / bits
codes per byte and P = G / n codes per plane, byte k holds the codes of columns

    k, k + P, k + 2P, ..., k + (n-1)P      at bit offsets 0, bits, 2 bits, ..., (n-1) bits.

So unpacking plane j of a group is one shift and one mask over B consecutive bytes, and its P codes
are consecutive columns: a kernel decodes each plane in its own loop with uint8 constants and
multiplies against a contiguous slice of x (what makes numba emit wide SIMD).
INT8 is the degenerate case n = 1 (the codes themselves).

Codes are unsigned (0 .. 2**bits - 1); the value of a code is (code - zero) * scale, with scale and
zero per (row, group), see edgemoe.quant.tensor.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from edgemoe.errors import EdgeMoEError


class QuantError(EdgeMoEError):
    """Bad input to quantization or to a quantized tensor (width, shape, dtype, values)."""


@dataclass(frozen=True)
class QuantFormat:
    """One bit width: how many codes share a byte, and the largest code."""

    bits: int

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    def padded_group(self, group: int) -> int:
        """Smallest group size >= group that whole bytes hold."""
        return -(-group // self.per_byte) * self.per_byte

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """codes uint8 [R, NG, G] (values <= qmax) -> packed uint8 [R, NG * G * bits / 8]."""
        rows, ng, g = codes.shape
        planes = codes.reshape(rows, ng, self.per_byte, g // self.per_byte)  # [R, NG, n, P]
        packed = torch.zeros(rows, ng, g // self.per_byte, dtype=torch.uint8)
        for j in range(self.per_byte):
            packed |= planes[:, :, j, :] << (j * self.bits)
        return packed.reshape(rows, -1)

    def unpack(self, packed: torch.Tensor, group: int) -> torch.Tensor:
        """packed uint8 [R, NG * B] -> codes uint8 [R, NG, G] (G = padded group size)."""
        rows = packed.shape[0]
        plane = group // self.per_byte
        by_group = packed.reshape(rows, -1, plane)  # [R, NG, P]
        planes = [(by_group >> (j * self.bits)) & self.qmax for j in range(self.per_byte)]
        return torch.stack(planes, dim=2).reshape(rows, -1, group)


FORMATS: dict[int, QuantFormat] = {bits: QuantFormat(bits) for bits in (2, 4, 8)}


def get_format(bits: int) -> QuantFormat:
    # True and 4.0 compare equal to widths but are not ones.
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in FORMATS:
        raise QuantError(f"bits={bits!r}: supported widths are {sorted(FORMATS)}")
    return FORMATS[int(bits)]
