"""MXFP4, the OCP microscaling format GPT-OSS checkpoints store their experts in: decoded on read.

A row of C values is stored as G = C/32 blocks of 32: 16 bytes of FP4 (e2m1) codes, two per byte, the
low nibble first, and one byte of scale, an e8m0 exponent with bias 127. Value = E2M1[code] * 2^(scale - 127).
On disk (tensor names `..._blocks` / `..._scales`): blocks uint8 [..., G, 16], scales uint8 [..., G].

Shapes: G blocks per row, C = 32 G values per row.
"""

from __future__ import annotations

import torch

from .errors import CheckpointError

BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_mxfp4_shapes(blocks_name: str, blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...],
                       rows_cols: tuple[int, ...]) -> list[str]:
    """Problems (empty when none) with a blocks/scales pair that should decode to [..., rows, cols]."""
    *lead, cols = rows_cols
    if cols % BLOCK:
        return [f"tensor {blocks_name}: MXFP4 rows of {cols} values are not whole blocks of {BLOCK}"]
    expected_blocks = (*lead, cols // BLOCK, BLOCK // 2)
    problems = []
    if tuple(blocks_shape) != expected_blocks:
        problems.append(f"tensor {blocks_name} has shape {tuple(blocks_shape)}, expected {expected_blocks} "
                        f"(MXFP4 blocks of {tuple(rows_cols)})")
    if tuple(scales_shape) != expected_blocks[:-1]:
        problems.append(f"tensor {blocks_name.removesuffix('_blocks')}_scales has shape {tuple(scales_shape)}, "
                        f"expected {expected_blocks[:-1]}")
    return problems


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "mxfp4") -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., 32 G]. Exact: every value is
    a small power-of-two multiple, representable in float32 for any exponent but the extreme few."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                              f"{tuple(scales.shape)} (expected blocks [..., G, 16], scales [..., G])")
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()       # [..., G, 16, 2]: low nibble first
    values = table[codes].flatten(-2)                                       # [..., G, 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents[..., None].float()).flatten(-2)   # [..., 32 G]
