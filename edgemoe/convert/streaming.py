"""The budget search's work files: what it would otherwise hold in RAM for every layer at once
(docs/budget.md, "Streaming calibration: bounded memory").

PackedExperts: every expert's packed weights at every width, appended once as each layer is
quantized (the store's blob encoding, edgemoe.store.format), read back one expert at a time.
WindowStates: one tensor [T_i, D] per calibration window (and per layer, for the layer-input
cache), in a file read and written with pread/pwrite: file pages live in the page cache, which the
kernel reclaims, not in the process's memory.

Both live in a work directory the caller owns (the partial store's), removed by close().
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from edgemoe.quant import QuantizedTensor
from edgemoe.store.format import decode_blob

from .writer import AlignedAppender

Key = tuple[int, int]


class PackedExperts:
    """Packed experts by (key, bits), in `path`."""

    def __init__(self, path: Path):
        self._appender = AlignedAppender(path, None)
        self._fd = os.open(path, os.O_RDONLY)
        self._entries = {}

    def add(self, key: Key, bits: int, quantized: dict[str, QuantizedTensor]) -> None:
        self._entries[key, bits] = self._appender.append(key, quantized)
        self._appender.file.flush()       # readable through _fd at once

    def get(self, key: Key, bits: int) -> dict[str, QuantizedTensor]:
        """The expert `key` packed at `bits` (its own buffer: safe from several threads)."""
        entry = self._entries[key, bits]
        blob = np.empty(entry.length, np.uint8)
        if os.preadv(self._fd, [blob], entry.offset) != entry.length:
            raise OSError(f"{self._appender.path}: short read of expert {key} at {bits} bits")
        return decode_blob(entry, blob)

    def close(self) -> None:
        self._appender.close()
        os.close(self._fd)


class WindowStates:
    """Float tensors [sizes[i], dim] of `dtype`, one per window and slot (slots: layers, or 1), in
    `path`. Unwritten slots take no disk (a sparse file)."""

    def __init__(self, path: Path, sizes: list[int], dim: int, dtype: torch.dtype, slots: int = 1):
        self.dim, self.dtype = dim, dtype
        row = dim * dtype.itemsize
        self._starts = np.concatenate(([0], np.cumsum(sizes))) * row
        self._slot_bytes = int(self._starts[-1])
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, self._slot_bytes * slots)

    def _span(self, i: int, slot: int) -> tuple[int, int]:
        return slot * self._slot_bytes + int(self._starts[i]), int(self._starts[i + 1] - self._starts[i])

    def write(self, i: int, x: torch.Tensor, slot: int = 0) -> None:
        offset, nbytes = self._span(i, slot)
        data = x.detach().to(self.dtype).contiguous().view(torch.uint8).numpy()
        if data.nbytes != nbytes or os.pwritev(self._fd, [data], offset) != nbytes:
            raise OSError(f"window {i}: short write of its hidden states")

    def read(self, i: int, slot: int = 0) -> torch.Tensor:
        offset, nbytes = self._span(i, slot)
        buf = bytearray(nbytes)
        if os.preadv(self._fd, [buf], offset) != nbytes:
            raise OSError(f"window {i}: short read of its hidden states")
        return torch.frombuffer(buf, dtype=self.dtype).reshape(-1, self.dim)

    def close(self) -> None:
        os.close(self._fd)


class WorkDirectory:
    """A directory of work files under `parent` (None: the system's temporary directory), removed
    by close(), at the latest when the object is collected."""

    def __init__(self, parent: Path | None = None):
        self._dir = tempfile.TemporaryDirectory(prefix=f"search-{os.getpid()}-", dir=parent)
        self.path = Path(self._dir.name)

    def close(self) -> None:
        self._dir.cleanup()
