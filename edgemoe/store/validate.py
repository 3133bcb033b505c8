"""Every field of a store's manifest, checked when the store is opened (docs/store-format.md).

A hand-edited or damaged manifest is refused then, with one line naming manifest.json, the entry
(layer and expert) and the field, rather than met mid-generation. Each expert entry is checked
against the model's spec (layer, expert, matrix shapes), the format (widths, group sizes, the blob
layout the widths and shapes imply, alignment, checksum form) and the data files (inside them, no two
blobs overlapping); fallback copies are narrower than their experts.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from edgemoe.quant import ARRAY_DTYPES, FORMATS, QuantError, group_layout
from edgemoe.spec import ModelSpec

from .format import ALIGNMENT, ARRAY_ALIGNMENT, ExpertEntry, StoreError, align, matrix_layout

SUPPORTED_BITS = tuple(sorted(FORMATS))   # the widths edgemoe.quant packs
FALLBACK_BITS = (2, 4)    # narrower than some expert's width
COMPRESSIONS = (None, "zstd")
ENTRY_FIELDS = ("layer", "expert", "bits", "file", "offset", "length", "stored_length", "compression", "crc32",
                "tensors")
TENSOR_FIELDS = ("shape", "bits", "group_size", "arrays")
ARRAY_FIELDS = ("offset", "dtype", "shape")


class _Where:
    """Names a place in the manifest for an error: manifest.json, the entry, the field."""

    def __init__(self, manifest: Path, entry: str = ""):
        self.manifest, self.entry = manifest, entry

    def fail(self, field: str, problem: str):
        entry = f"{self.entry}: " if self.entry else ""
        raise StoreError(f"{self.manifest}: {entry}{field}: {problem}")


def _integer(where: _Where, field: str, value, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        where.fail(field, f"{value!r} is not an integer")
    if value < low:
        where.fail(field, f"{value} is below {low}")
    if high is not None and value > high:
        where.fail(field, f"{value} is above {high}")
    return int(value)


def _record(where: _Where, field: str, value, keys: tuple[str, ...]) -> dict:
    """A JSON object with exactly `keys`."""
    if not isinstance(value, dict):
        where.fail(field, f"expected an object, got {type(value).__name__}")
    missing, unknown = [k for k in keys if k not in value], sorted(set(value) - set(keys))
    if missing:
        where.fail(f"{field}.{missing[0]}" if field else missing[0], "missing")
    if unknown:
        where.fail(f"{field}.{unknown[0]}" if field else unknown[0], "unknown field")
    return value


def check_header(path: Path, data: dict) -> None:
    """The top-level fields other than format, version, complete (checked first) and the entries."""
    where = _Where(path)
    if data.get("alignment") != ALIGNMENT:
        where.fail("alignment", f"{data.get('alignment')!r}, this format aligns blobs to {ALIGNMENT} bytes")
    if data.get("checksum") != "crc32":
        where.fail("checksum", f"{data.get('checksum')!r}, this format's checksum is crc32")
    dense = _record(where, "dense", data.get("dense"), ("file", "size", "crc32"))
    _file_name(where, "dense.file", dense["file"])
    _integer(where, "dense.size", dense["size"])
    _integer(where, "dense.crc32", dense["crc32"], 0, 0xFFFFFFFF)
    quantization = data.get("quantization")
    if not isinstance(quantization, dict):
        where.fail("quantization", "missing or not an object")
    if quantization.get("array_alignment") != ARRAY_ALIGNMENT:
        where.fail("quantization.array_alignment", f"{quantization.get('array_alignment')!r}, this format "
                                                   f"aligns arrays to {ARRAY_ALIGNMENT} bytes")
    files = data.get("data_files")
    if not isinstance(files, list):
        where.fail("data_files", "missing or not a list")
    for i, record in enumerate(files):
        record = _record(where, f"data_files[{i}]", record, ("name", "size"))
        _file_name(where, f"data_files[{i}].name", record["name"])
        _integer(where, f"data_files[{i}].size", record["size"])
    if not isinstance(data.get("experts"), list):
        where.fail("experts", "missing or not a list")
    if "fallback" in data:
        fallback = _record(where, "fallback", data["fallback"], ("bits", "experts"))
        if fallback["bits"] not in FALLBACK_BITS or isinstance(fallback["bits"], bool):
            where.fail("fallback.bits", f"{fallback['bits']!r}, expected one of {FALLBACK_BITS}")
        if not isinstance(fallback["experts"], list):
            where.fail("fallback.experts", "not a list")


def _file_name(where: _Where, field: str, name) -> None:
    """A file of the store directory itself: a plain name, no path."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        where.fail(field, f"{name!r} is not a file name in the store directory")


def parse_entries(path: Path, records: list, spec: ModelSpec, sizes: dict[str, int], listed_as: str,
                  widths: tuple[int, ...] = SUPPORTED_BITS) -> tuple[dict, dict]:
    """The entries of `records` (listed_as: "experts" or "fallback.experts"), each checked in full, no
    (layer, expert) twice: ({key: ExpertEntry}, {key: its label, e.g. "experts[3] (layer 1 expert 0)"})."""
    entries, labels = {}, {}
    for i, record in enumerate(records):
        where = _Where(path, f"{listed_as}[{i}]")
        entry = check_entry(where, record, spec, sizes, widths)
        if entry.key in entries:
            where.fail("layer, expert", f"listed twice (also {labels[entry.key]})")
        entries[entry.key], labels[entry.key] = entry, where.entry
    return entries, labels


def check_entry(where: _Where, record, spec: ModelSpec, sizes: dict[str, int], widths: tuple[int, ...]) -> ExpertEntry:
    """One expert entry: every field against the spec, the format and the data files."""
    if isinstance(record, dict):   # named by its layer and expert as written, before they are checked
        where.entry += f" (layer {record.get('layer', '?')} expert {record.get('expert', '?')})"
    record = _record(where, "", record, ENTRY_FIELDS)
    layer = _integer(where, "layer", record["layer"])
    if layer not in spec.moe_layer_ids:
        where.fail("layer", f"{layer} is not a MoE layer of the model (those are {list(spec.moe_layer_ids)})")
    _integer(where, "expert", record["expert"], 0, spec.num_experts - 1)
    bits = record["bits"]
    if isinstance(bits, bool) or bits not in widths:
        where.fail("bits", f"{bits!r}, expected {' or '.join(map(str, widths))}")
    _placement(where, record, sizes)
    _integer(where, "crc32", record["crc32"], 0, 0xFFFFFFFF)
    _layout(where, record, spec)
    return ExpertEntry(**record)


def _placement(where: _Where, record: dict, sizes: dict[str, int]) -> None:
    """file, offset, length, stored_length, compression: an aligned range inside a listed data file."""
    if record["file"] not in sizes:
        where.fail("file", f"{record['file']!r} is not one of the data files {sorted(sizes)}")
    offset = _integer(where, "offset", record["offset"])
    if offset % ALIGNMENT:
        where.fail("offset", f"{offset} is not a multiple of {ALIGNMENT}")
    length = _integer(where, "length", record["length"], 1)
    stored = _integer(where, "stored_length", record["stored_length"], 1)
    if record["compression"] not in COMPRESSIONS:
        where.fail("compression", f"{record['compression']!r}, expected null or 'zstd'")
    if record["compression"] is None and stored != length:
        where.fail("stored_length", f"{stored}, an uncompressed blob is stored as its {length} bytes (length)")
    end, size = offset + align(stored, ALIGNMENT), sizes[record["file"]]
    if end > size:
        where.fail("offset", f"bytes {offset}..{end} (stored_length {stored}, read a page at a time) lie past the "
                             f"end of {record['file']} ({size} bytes)")


def _layout(where: _Where, record: dict, spec: ModelSpec) -> None:
    """tensors: the spec's roles and shapes at the entry's width, laid out as the format lays out those
    matrices (array offsets, dtypes and shapes), filling exactly `length` bytes."""
    tensors = record["tensors"]
    roles = spec.expert_roles
    if not isinstance(tensors, dict):
        where.fail("tensors", f"expected an object, got {type(tensors).__name__}")
    for role in [*roles, *sorted(set(tensors) - set(roles))]:
        if (role in tensors) != (role in roles):
            where.fail(f"tensors.{role}", f"{'missing' if role in roles else 'held'}: a {spec.expert_activation} "
                                          f"expert has {list(roles)}")
    matrices = {}
    for role, shape in spec.expert_shapes().items():
        field = f"tensors.{role}"
        t = _record(where, field, tensors[role], TENSOR_FIELDS)
        if t["shape"] != list(shape):
            where.fail(f"{field}.shape", f"{t['shape']!r}, the model's {role} matrix is {list(shape)}")
        if t["bits"] != record["bits"] or isinstance(t["bits"], bool):
            where.fail(f"{field}.bits", f"{t['bits']!r}, the entry's bits are {record['bits']}")
        try:
            group_layout(record["bits"], t["group_size"], shape[1])
        except QuantError as e:
            where.fail(f"{field}.group_size", str(e).split(": ", 1)[-1])
        matrices[role] = (record["bits"], t["group_size"], shape)
    expected, length = matrix_layout(matrices)
    for role in roles:
        arrays = _record(where, f"tensors.{role}.arrays", tensors[role]["arrays"], tuple(ARRAY_DTYPES))
        for name, want in expected[role]["arrays"].items():
            field = f"tensors.{role}.arrays.{name}"
            got = _record(where, field, arrays[name], ARRAY_FIELDS)
            for key in ARRAY_FIELDS:
                if got[key] != want[key] or isinstance(got[key], bool):
                    where.fail(f"{field}.{key}", f"{got[key]!r}, the layout of {record['bits']}-bit "
                                                 f"{list(matrices[role][2])} matrices has {want[key]!r}")
    if record["length"] != length:
        where.fail("length", f"{record['length']}, the blob of these matrices is {length} bytes")


def check_overlaps(path: Path, labelled: list[tuple[str, ExpertEntry]]) -> None:
    """No two blobs of one data file share a byte."""
    by_file: dict[str, list[tuple[str, ExpertEntry]]] = {}
    for label, entry in labelled:
        by_file.setdefault(entry.file, []).append((label, entry))
    for blobs in by_file.values():
        blobs.sort(key=lambda item: item[1].offset)
        for (before_label, before), (label, after) in zip(blobs, blobs[1:]):
            end = before.offset + before.stored_length
            if after.offset < end:
                _Where(path, label).fail("offset", f"{after.offset} overlaps the blob of {before_label} "
                                                   f"(bytes {before.offset}..{end})")


def check_fallback(path: Path, bits: int, experts: dict, fallback: dict) -> None:
    """Each copy is of a listed expert and narrower than it; every wider expert has one."""
    for key, copy in fallback.items():
        if key not in experts:
            _Where(path, f"fallback copy (layer {key[0]} expert {key[1]})").fail("layer, expert", "no such expert")
        if copy.bits >= experts[key].bits:
            _Where(path, f"fallback copy (layer {key[0]} expert {key[1]})").fail(
                "bits", f"{copy.bits} for a {experts[key].bits}-bit expert (fallback.bits {bits})")
    for key, entry in experts.items():
        if entry.bits > bits and key not in fallback:
            _Where(path, f"layer {key[0]} expert {key[1]}").fail(
                "fallback.experts", f"no {bits}-bit copy of this {entry.bits}-bit expert")
