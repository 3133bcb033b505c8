"""Lazy reader of a Hugging Face checkpoint directory.

A checkpoint is config.json plus one safetensors file (model.safetensors) or several with an index
(model.safetensors.index.json). Every file's header is parsed and each entry checked (dtype, shape,
offsets inside the file that hold exactly the shape's bytes, no overlap) when the directory is opened,
so a truncated download fails at once, naming the file and tensor, instead of midway through a load.
Tensors are then read one at a time with pread into memory the caller owns, each checked finite, and
their pages are dropped from the page cache (Linux): a converter's memory stays bounded by the
tensors it holds, however large the checkpoint (a memory map would leave every page it touched
resident and counted against the process).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from .errors import CheckpointError

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
PACKED_DTYPES = {"U8": torch.uint8}   # codes of a quantized source format (MXFP4), read only as such


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0       # absolute byte offset of the data in the file
    nbytes: int = 0


# Elements summed at a time by all_finite: torch's sum(dtype=float64) of a narrower tensor first makes a
# float64 copy of it (measured: +250 MB for a 32,000 x 1,024 bfloat16 embedding), so a block at a time.
FINITE_CHECK_BLOCK = 1 << 20


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of a floating tensor is finite. A float64 sum is finite when every term is
    (an inf or a nan carries through, and float32 or narrower values cannot overflow it): a fast
    reduction, where torch.isfinite of a whole 151,936 x 2,048 embedding would be a 297 MiB temporary
    and several times slower on bfloat16. It runs a block of FINITE_CHECK_BLOCK values at a time, so
    that its float64 copy is 8 MiB whatever the tensor. Only a block whose sum is not finite is
    checked value by value (a float64 tensor's sum can overflow)."""
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), FINITE_CHECK_BLOCK):
        block = flat[start:start + FINITE_CHECK_BLOCK]
        if not (torch.isfinite(block.sum(dtype=torch.float64)) or torch.isfinite(block).all()):
            return False
    return True


def check_finite(tensor: torch.Tensor, where: str, error: type[Exception] = CheckpointError) -> torch.Tensor:
    """`tensor` if every value is finite, else `error` naming `where` ("FILE: tensor NAME"). Called once
    on each weight as it is loaded (one cheap pass), so that a NaN or an infinity is refused by name
    there, not met later as a failed sampling step or a nan perplexity."""
    if tensor.is_floating_point() and not all_finite(tensor):
        bad = int((~torch.isfinite(tensor)).sum())
        raise error(f"{where}: {bad} non-finite value{'s' if bad > 1 else ''} (nan or inf) of {tensor.numel()}")
    return tensor


def read_json(path: Path) -> dict:
    """A JSON object from a file; CheckpointError naming the file for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found a {type(data).__name__}")
    return data


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check that the file holds every byte it promises."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes, "
                                  f"file of {size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    header.pop("__metadata__", None)
    data_start, data_size = 8 + header_len, size - 8 - header_len
    infos = {name: _tensor_info(path, name, entry, data_start, data_size) for name, entry in header.items()}
    _check_no_overlap(path, infos)
    return infos


def _is_index_list(value) -> bool:
    """A JSON list of non-negative integers (a shape, a pair of offsets)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _tensor_info(path: Path, name: str, entry, data_start: int, data_size: int) -> TensorInfo:
    """One header entry, checked: a known dtype, a shape, offsets inside the data section that hold
    exactly the shape's bytes. Errors name the file and the tensor."""
    where = f"{path}: tensor {name!r}"
    missing = [key for key in ("dtype", "shape", "data_offsets") if not isinstance(entry, dict) or key not in entry]
    if missing:
        raise CheckpointError(f"{where}: header entry has no {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    if not _is_index_list(shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (_is_index_list(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not a pair of integers 0 <= begin <= end")
    begin, end = offsets
    if end > data_size:
        raise CheckpointError(f"{where}: data_offsets {offsets} reach past the {data_size} bytes of data "
                              f"in the file (truncated safetensors file?)")
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {tuple(shape)} {dtype}")
    return TensorInfo(path, dtype, tuple(shape), data_start + begin, end - begin)


def _check_no_overlap(path: Path, infos: dict[str, TensorInfo]) -> None:
    """No two tensors share a byte (empty tensors share none)."""
    spans = sorted((info.offset, info.offset + info.nbytes, name) for name, info in infos.items() if info.nbytes)
    for (_, end, before), (begin, _, after) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {before!r} and {after!r} overlap in the data section")


class Checkpoint:
    """The tensors of a checkpoint directory, by name, read lazily. Tracks which were read."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such checkpoint directory")
        self.config = read_json(self.path / "config.json")
        self.tensors = self._index_tensors()
        self.used: set[str] = set()
        self._handles: dict[Path, int] = {}   # open file descriptors

    def _index_tensors(self) -> dict[str, TensorInfo]:
        index_path = self.path / "model.safetensors.index.json"
        if index_path.exists():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index_path}: no 'weight_map' of tensor names to file names")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors file")
        tensors: dict[str, TensorInfo] = {}
        for name in files:
            file = self.path / name
            if not file.exists():
                raise CheckpointError(f"{file}: listed in the index but missing")
            for tensor, info in read_safetensors_header(file).items():
                if tensor in tensors:
                    raise CheckpointError(f"{file}: tensor {tensor!r} also in {tensors[tensor].file.name}")
                tensors[tensor] = info
        return tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read one tensor (optionally cast), and mark it used."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found")
        tensor = self._read(info, info.offset, info.nbytes, info.shape, f"tensor {name!r}")
        self.used.add(name)
        return tensor if dtype is None else tensor.to(dtype)

    def _read(self, info: TensorInfo, offset: int, nbytes: int, shape, where: str,
              packed: bool = False) -> torch.Tensor:
        """Bytes offset.. of info's file as a tensor of `shape`, its values checked finite (`where` names
        it in the error)."""
        dtypes = {**TORCH_DTYPES, **PACKED_DTYPES} if packed else TORCH_DTYPES
        if info.dtype not in dtypes:
            raise CheckpointError(f"{info.file}: dtype {info.dtype} is not supported ({', '.join(dtypes)})")
        fd = self._handles.get(info.file)
        if fd is None:
            fd = self._handles[info.file] = os.open(info.file, os.O_RDONLY)
        return check_finite(pread_tensor(fd, info.file, offset, nbytes, shape, dtypes[info.dtype]), f"{info.file}: {where}")

    def unused(self) -> list[str]:
        return sorted(set(self.tensors) - self.used)

    def close(self) -> None:
        for fd in self._handles.values():
            os.close(fd)
        self._handles.clear()


def pread_tensor(fd: int, file: Path, offset: int, nbytes: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Bytes offset..offset+nbytes of an open file as a tensor of `shape` that owns its memory; their
    pages dropped from the page cache (read once, they would only double the bytes held)."""
    buf = bytearray(nbytes)
    if os.preadv(fd, [buf], offset) != nbytes:
        raise CheckpointError(f"{file}: short read (file changed or truncated)")
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def read_slice(ckpt: Checkpoint, name: str, index: int, dtype: torch.dtype | None = None,
               packed: bool = False) -> torch.Tensor:
    """Read tensor[index] of a stacked tensor without reading the rest (fused expert layouts);
    packed: the tensor holds uint8 codes (MXFP4 blocks and scales), returned as they are."""
    info = ckpt.tensors[name]
    row = info.nbytes // info.shape[0]
    tensor = ckpt._read(info, info.offset + index * row, row, info.shape[1:], f"tensor {name!r} [{index}]", packed)
    ckpt.used.add(name)
    return tensor if dtype is None else tensor.to(dtype)


def write_safetensors(path: Path, items: list[tuple[str, str, tuple[int, ...], "callable"]]) -> int:
    """Write a safetensors file one tensor at a time: items are (name, dtype, shape, produce) where
    produce() returns the tensor only when its turn comes, so memory holds one tensor at once.
    Returns the CRC-32 of the whole file; fsyncs it."""
    import zlib

    header, offset = {}, 0
    for name, dtype, shape, _ in items:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n * DTYPE_BYTES[dtype]]}
        offset += n * DTYPE_BYTES[dtype]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned
    checksum = 0
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            checksum = zlib.crc32(chunk, checksum)
        for name, dtype, shape, produce in items:
            tensor = produce()
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != TORCH_DTYPES.get(dtype, tensor.dtype):
                raise ValueError(f"write_safetensors: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"declared {tuple(shape)} {dtype}")
            data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            f.write(data)
            checksum = zlib.crc32(data, checksum)
        f.flush()
        os.fsync(f.fileno())
    return checksum & 0xFFFFFFFF
