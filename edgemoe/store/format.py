"""The store's on-disk format (docs/store-format.md): manifest, blob layout, checksums.

Shapes: I expert hidden, D hidden; see edgemoe.quant for the packed arrays.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.files import atomic_write
from edgemoe.spec import ModelSpec
from edgemoe.quant import ARRAY_DTYPES, QuantizedTensor, group_layout

FORMAT_NAME = "edgemoe-store"
FORMAT_VERSION = 1
ALIGNMENT = 4096          # every blob starts on a page: one aligned read (O_DIRECT-able) per expert
ARRAY_ALIGNMENT = 64      # every array inside a blob starts on a cache line
MANIFEST = "manifest.json"
DENSE_FILE = "dense.safetensors"
FALLBACK_FILE = "fallback-00000.bin"   # the experts' narrower copies (optional)
PROFILE = "profile.json"
EXPERT_ROLES = ("gate", "up", "down")   # the order of an expert's matrices in its blob (those it has)
ARRAY_NAMES = ("packed", "scale", "zero")
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


class StoreError(EdgeMoEError):
    """A store that is missing, incomplete, of an unknown version, or corrupt."""


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def file_crc32(path: Path, chunk: int = 8 << 20) -> int:
    """CRC-32 of a whole file, read `chunk` bytes at a time (never the whole file in memory)."""
    value = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            value = zlib.crc32(block, value)
    return value & 0xFFFFFFFF


def align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class ExpertEntry:
    """One expert's record in the manifest."""

    layer: int
    expert: int
    bits: int
    file: str
    offset: int
    length: int           # blob bytes (decompressed)
    stored_length: int    # bytes on disk
    compression: str | None
    crc32: int            # of the stored bytes
    tensors: dict         # role -> {"shape", "bits", "group_size", "arrays": {name -> {offset, dtype, shape}}}

    @property
    def key(self) -> tuple[int, int]:
        return self.layer, self.expert

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def where(self) -> str:
        return f"layer {self.layer} expert {self.expert} ({self.file} at byte {self.offset})"

    @cached_property
    def views(self) -> tuple:
        """How decode_blob cuts this expert's blob, worked out and checked once (a store reads an
        expert many times): per role (role, bits, group_size, shape, group, arrays), arrays in
        ARRAY_DTYPES' order as (start, stop, dtype, 2-D shape)."""
        out = []
        for role in _roles_of(self.tensors):
            t = self.tensors[role]
            cuts = {}
            for name, a in t["arrays"].items():
                dtype = np.dtype(a["dtype"])
                start = a["offset"]
                stop = start + int(np.prod(a["shape"])) * dtype.itemsize
                if not 0 <= start <= stop <= self.length:
                    raise StoreError(f"{self.where()}: {role} {name} at bytes {start}-{stop} lies outside its "
                                     f"{self.length}-byte blob: the manifest is corrupt")
                cuts[name] = (start, stop, dtype)
            # QuantizedTensor's own checks, once, on arrays of the sizes the blob gives
            qt = QuantizedTensor.from_arrays(t["bits"], t["group_size"], tuple(t["shape"]),
                                             {name: np.zeros((stop - start) // dtype.itemsize, dtype)
                                              for name, (start, stop, dtype) in cuts.items()})
            arrays = tuple((*cuts[name], getattr(qt, name).shape) for name in ARRAY_DTYPES)
            out.append((role, qt.bits, qt.group_size, qt.shape, qt.group, arrays))
        return tuple(out)


def _roles_of(tensors: dict) -> list[str]:
    """An expert's roles in blob order: gate, up, down for SwiGLU, up, down for an ungated expert."""
    return [role for role in EXPERT_ROLES if role in tensors]


def blob_layout(quantized: dict[str, QuantizedTensor]) -> tuple[dict, int]:
    """Where each array of an expert goes inside its blob: (tensors record, blob length)."""
    return matrix_layout({role: (qt.bits, qt.group_size, qt.shape) for role, qt in quantized.items()})


def matrix_layout(matrices: dict[str, tuple[int, int | None, tuple[int, int]]]) -> tuple[dict, int]:
    """The blob layout of an expert's matrices, role -> (bits, group_size, [rows, cols]): each role's
    packed, scale and zero arrays in turn, each starting on ARRAY_ALIGNMENT. (tensors record, length)."""
    tensors, offset = {}, 0
    for role in _roles_of(matrices):
        bits, group_size, (rows, cols) = matrices[role]
        group, ngroups = group_layout(bits, group_size, cols)
        shapes = {"packed": [rows, ngroups * group * bits // 8], "scale": [rows, ngroups], "zero": [rows, ngroups]}
        arrays = {}
        for name, dtype in ARRAY_DTYPES.items():
            offset = align(offset, ARRAY_ALIGNMENT)
            arrays[name] = {"offset": offset, "dtype": np.dtype(dtype).name, "shape": shapes[name]}
            offset += rows * shapes[name][1] * np.dtype(dtype).itemsize
        tensors[role] = {"shape": [rows, cols], "bits": bits, "group_size": group_size, "arrays": arrays}
    return tensors, offset


def encode_blob(quantized: dict[str, QuantizedTensor]) -> tuple[dict, bytes]:
    tensors, length = blob_layout(quantized)
    blob = bytearray(length)
    for role in _roles_of(quantized):
        for name, array in quantized[role].arrays().items():
            start = tensors[role]["arrays"][name]["offset"]
            blob[start:start + array.nbytes] = array.tobytes()
    return tensors, bytes(blob)


def decode_blob(entry: ExpertEntry, blob: np.ndarray) -> dict[str, QuantizedTensor]:
    """Zero-copy QuantizedTensors over a blob buffer (uint8 array of entry.length bytes)."""
    if blob.shape != (entry.length,):
        raise StoreError(f"{entry.where()}: a blob of {blob.shape[0]} bytes where the manifest says {entry.length}")
    out = {}
    for role, bits, group_size, shape, group, arrays in entry.views:
        views = []
        for start, stop, dtype, shape2 in arrays:
            view = blob[start:stop].view(dtype).reshape(shape2)
            view.flags.writeable = False
            views.append(view)
        out[role] = QuantizedTensor.checked_views(bits, group_size, shape, group, *views)
    return out


@dataclass
class Manifest:
    path: Path
    data: dict
    spec: ModelSpec
    experts: dict[tuple[int, int], ExpertEntry]
    fallback: dict[tuple[int, int], ExpertEntry]   # narrower copies of the wider experts; {} if none

    @property
    def quantization(self) -> dict:
        return self.data["quantization"]

    @property
    def expert_bytes(self) -> int:
        """Bytes of every expert as held in RAM (decoded blobs): what a RAM share like 25% is of."""
        return sum(e.length for e in self.experts.values())

    @property
    def fallback_bits(self) -> int | None:
        """The width of the experts' narrower copies, None when the store has none."""
        return self.data["fallback"]["bits"] if "fallback" in self.data else None


def write_json_atomic(path: Path, data: dict) -> None:
    atomic_write(path, lambda f: json.dump(data, f, indent=1))


def read_manifest(store: Path) -> Manifest:
    """Parse and validate manifest.json; StoreError naming the problem otherwise."""
    store = Path(store)
    path = store / MANIFEST
    if not store.is_dir():
        raise StoreError(f"{store}: no such store directory")
    if not path.exists():
        raise StoreError(f"{store}: no {MANIFEST}: not a store, or an incomplete one (interrupted convert?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: corrupt manifest ({e})") from None
    return parse_manifest(store, data)


def parse_manifest(store: Path, data: dict) -> Manifest:
    """Validate a manifest's contents against the store directory's files (the converter checks
    the manifest it is about to write this way, before writing it)."""
    store = Path(store)
    path = store / MANIFEST
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        found = data.get("format") if isinstance(data, dict) else None
        raise StoreError(f"{path}: not an edgemoe store manifest (format={found!r})")
    if data.get("version") != FORMAT_VERSION:
        raise StoreError(f"{path}: store format version {data.get('version')!r} is not supported "
                         f"(this edgemoe reads version {FORMAT_VERSION})")
    if data.get("complete") is not True:
        raise StoreError(f"{path}: the store is marked incomplete")
    from . import validate   # it checks against this module's definitions

    validate.check_header(path, data)
    try:
        spec = ModelSpec.from_dict(data["spec"])
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{path}: spec: malformed ({e})") from None
    sizes = {f["name"]: f["size"] for f in data["data_files"]}
    _check_files(store, data, sizes)
    experts, labels = validate.parse_entries(path, data["experts"], spec, sizes, "experts")
    fallback, fallback_labels = {}, {}
    if "fallback" in data:
        fallback, fallback_labels = validate.parse_entries(path, data["fallback"]["experts"], spec, sizes,
                                                           "fallback.experts", (data["fallback"]["bits"],))
        validate.check_fallback(path, data["fallback"]["bits"], experts, fallback)
    validate.check_overlaps(path, [(labels[k], e) for k, e in experts.items()]
                            + [(fallback_labels[k], e) for k, e in fallback.items()])
    expected = {(l, e) for l in spec.moe_layer_ids for e in range(spec.num_experts)}
    if set(experts) != expected:
        missing = sorted(expected - set(experts))[:5]
        raise StoreError(f"{path}: manifest lists {len(experts)} experts, the model has {len(expected)} "
                         f"(missing e.g. {missing})")
    return Manifest(store, data, spec, experts, fallback)


def _check_files(store: Path, data: dict, sizes: dict[str, int]) -> None:
    for name, size in list(sizes.items()) + [(data["dense"]["file"], data["dense"]["size"])]:
        file = store / name
        if not file.exists():
            raise StoreError(f"{file}: missing (listed in {MANIFEST})")
        actual = file.stat().st_size
        if actual != size:
            raise StoreError(f"{file}: {actual} bytes, the manifest says {size} ({MANIFEST}; truncated or replaced)")
