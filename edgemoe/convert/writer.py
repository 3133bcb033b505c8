"""Writing a store (docs/store-format.md) so that it never looks complete before it is.

Everything goes into OUT.partial-<pid>: the copied config and tokenizer files, dense.safetensors
(dense tensors streamed one at a time), experts-00000.bin (expert blobs appended 4096-aligned,
each with its CRC-32, in (layer, expert) order) and, when asked, fallback-00000.bin (the experts'
narrower copies, laid out the same way). The manifest is written once, last, then the
directory is renamed into place; a failure or an interrupt removes the partial directory, and an
existing store (--force) is replaced only once the new one is complete.

An existing empty directory (a fresh mount point) is filled in place instead: the partial
directory is OUT/.partial-<pid> (on OUT's file system, where a rename beside it could not reach),
and its files are moved into OUT with the manifest last, so OUT holds no manifest, and opens as no
store, until it is complete; a failure takes the moved files out again, leaving OUT empty.

Shapes: see edgemoe.quant for the packed arrays.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import edgemoe
from edgemoe.checkpoint import Checkpoint, write_safetensors
from edgemoe.files import fsync_directory, refuse_input
from edgemoe.quant import QuantizedTensor, narrow
from edgemoe.spec import ModelSpec
from edgemoe.store.format import (ALIGNMENT, ARRAY_ALIGNMENT, COPIED_FILES, DENSE_FILE, FORMAT_NAME, FORMAT_VERSION,
                                  FALLBACK_FILE, MANIFEST, ExpertEntry, Manifest, StoreError, align, crc32,
                                  encode_blob, parse_manifest, write_json_atomic)

DATA_FILE = "experts-00000.bin"
Key = tuple[int, int]
Quantized = dict[str, QuantizedTensor]      # role -> packed weight


def read_widths(path: str | os.PathLike, spec: ModelSpec) -> dict[Key, int]:
    """A width file: {"widths": {"<layer>": [bits of expert 0, 1, ...]}} covering every MoE layer."""
    try:
        data = json.loads(Path(path).read_text())["widths"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise StoreError(f"{path}: not a width file ({e})") from None
    widths = {}
    for layer in spec.moe_layer_ids:
        row = data.get(str(layer))
        if not isinstance(row, list) or len(row) != spec.num_experts or any(b not in (2, 4, 8) for b in row):
            raise StoreError(f"{path}: layer {layer} needs a list of {spec.num_experts} widths from 2, 4, 8, "
                             f"got {row!r}")
        widths.update({(layer, e): int(b) for e, b in enumerate(row)})
    return widths


def check_destination(out: Path, force: bool, inputs: list[Path]) -> None:
    """Refuse, before any work, a destination whose replacement could lose data: `out` may not be or
    hold an input of the command (the checkpoint, a calibration text...) or be an existing file of
    one (edgemoe.files.refuse_input); it may be new or an empty directory, and otherwise exist only
    with `force` and only as a store (a directory with a manifest). Nothing is touched here."""
    out = Path(out)
    refuse_input(out, inputs)
    if (not out.exists() and not out.is_symlink()) or is_empty_directory(out):
        return
    if not force:
        raise StoreError(f"{out}: already exists (use --force to replace a store)")
    if out.is_symlink() or not out.is_dir() or not (out / MANIFEST).is_file():
        raise StoreError(f"{out}: not an edgemoe store (no {MANIFEST}); --force replaces only a store, "
                         f"so it was left untouched")


PARTIAL_INSIDE = ".partial-"    # the partial store's name inside an empty destination directory


def is_empty_directory(out: Path) -> bool:
    """An existing directory holding nothing, or only a killed convert's partial store: a destination
    filled in place, without --force."""
    return out.is_dir() and all(p.name.startswith(PARTIAL_INSIDE) for p in out.iterdir())


class StoreWriter:
    """A store being written at `out`; a context manager that removes the partial directory unless
    commit() ran. `partial` is where the files are until then: beside `out`, or inside it when `out`
    is an empty directory (in_place)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.in_place = is_empty_directory(self.out)
        where, prefix = (self.out, PARTIAL_INSIDE) if self.in_place else (self.out.parent, self.out.name + ".partial-")
        for stale in where.glob(prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.partial = where / f"{prefix}{os.getpid()}"
        self.partial.mkdir(parents=True)
        self.entries: list[ExpertEntry] = []
        self.fallback_entries: list[ExpertEntry] = []   # the experts' narrower copies (--fallback-bits)
        self.fallback_bits: int | None = None
        self._dense: dict | None = None
        self._committed = False

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc) -> None:
        if not self._committed:
            shutil.rmtree(self.partial, ignore_errors=True)

    def copy_files(self, source: Path) -> None:
        for name in COPIED_FILES:
            if (source / name).exists():
                shutil.copyfile(source / name, self.partial / name)

    def write_dense(self, ckpt: Checkpoint, dense_names: dict[str, str]) -> None:
        """Stream the dense tensors into dense.safetensors under their canonical names."""
        items = [(role, ckpt.tensors[name].dtype, ckpt.tensors[name].shape, lambda name=name: ckpt.get(name))
                 for role, name in sorted(dense_names.items())]
        checksum = write_safetensors(self.partial / DENSE_FILE, items)
        self._dense = {"file": DENSE_FILE, "size": (self.partial / DENSE_FILE).stat().st_size, "crc32": checksum}

    def write_experts(self, keys: list[Key], quantized: Callable[[Key], Quantized], compress: str | None,
                      workers: int, on_progress: Callable[[int, int], None] | None = None,
                      fallback_bits: int | None = None) -> None:
        """Append every expert's blob in `keys` order; `quantized(key)` runs on `workers` threads with
        at most workers + 1 experts in flight (bounded memory). fallback_bits: also write, to
        fallback-00000.bin, each wider expert's copy narrowed to that width (edgemoe.quant.narrow)."""
        self.fallback_bits = fallback_bits
        files = [DATA_FILE] + ([FALLBACK_FILE] if fallback_bits else [])
        outputs = {name: AlignedAppender(self.partial / name, compress) for name in files}
        try:
            with ThreadPoolExecutor(workers) as pool:
                pending = []
                for key in keys + [None] * (workers + 1):
                    if key is not None:
                        pending.append((key, pool.submit(quantized, key)))
                    if len(pending) > workers or (key is None and pending):
                        done_key, future = pending.pop(0)
                        self._append(outputs, done_key, future.result())
                        if on_progress:
                            on_progress(len(self.entries), len(keys))
            for output in outputs.values():
                output.finish()
        finally:
            for output in outputs.values():
                output.close()

    def _append(self, outputs: dict, key: Key, quantized: Quantized) -> None:
        self.entries.append(outputs[DATA_FILE].append(key, quantized))
        if self.fallback_bits and quantized["down"].bits > self.fallback_bits:
            narrowed = {role: narrow(qt, self.fallback_bits) for role, qt in quantized.items()}
            self.fallback_entries.append(outputs[FALLBACK_FILE].append(key, narrowed))

    def manifest(self, spec: ModelSpec, source: Path, method: str, group_size: int | None,
                 extra: dict | None = None) -> Manifest:
        """The manifest of what was written, checked against the files (not yet on disk)."""
        data = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "complete": True,
            "created_by": f"edgemoe {edgemoe.__version__}",
            "source": {"path": str(Path(source).resolve()), "model_type": spec.model_type},
            "spec": spec.to_dict(), "alignment": ALIGNMENT, "checksum": "crc32", "dense": self._dense,
            "quantization": {"method": method, "group_size": group_size, "array_alignment": ARRAY_ALIGNMENT},
            "data_files": [{"name": name, "size": (self.partial / name).stat().st_size}
                           for name in (DATA_FILE, FALLBACK_FILE) if (self.partial / name).exists()],
            "experts": [e.to_json() for e in self.entries],
            **({"fallback": {"bits": self.fallback_bits, "experts": [e.to_json() for e in self.fallback_entries]}}
               if self.fallback_bits else {}),
            **(extra or {}),
        }
        return parse_manifest(self.partial, data)

    def commit(self, manifest: Manifest) -> None:
        """Write the manifest, then move the store into place (replacing an old store only now)."""
        write_json_atomic(self.partial / MANIFEST, manifest.data)
        fsync_directory(self.partial)
        if self.in_place:
            self._fill_in_place()
        elif self.out.exists():
            trash = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, trash)
            os.replace(self.partial, self.out)
            shutil.rmtree(trash)
        else:
            os.replace(self.partial, self.out)
        fsync_directory(self.out.parent)
        self._committed = True

    def _fill_in_place(self) -> None:
        """Move the finished files into the empty `out`, the manifest last: until it arrives `out` is
        no store. A failure removes what was moved (the manifest first): `out` was empty before."""
        names = sorted((p.name for p in self.partial.iterdir()), key=lambda name: name == MANIFEST)
        try:
            for name in names:
                os.replace(self.partial / name, self.out / name)
        except BaseException:
            for name in reversed(names):
                (self.out / name).unlink(missing_ok=True)
            raise
        self.partial.rmdir()
        fsync_directory(self.out)


class AlignedAppender:
    """One data file being written: blobs appended 4096-aligned, each with its CRC-32, compressed
    when `compress` is "zstd"."""

    def __init__(self, path: Path, compress: str | None):
        self.path, self.compress = path, compress
        self.compressor = None
        if compress == "zstd":
            import zstandard
            self.compressor = zstandard.ZstdCompressor(level=3)
        self.file = open(path, "wb")
        self.offset = 0

    def append(self, key: Key, quantized: Quantized) -> ExpertEntry:
        tensors, blob = encode_blob(quantized)
        stored = self.compressor.compress(blob) if self.compressor else blob
        self.file.seek(self.offset)
        self.file.write(stored)
        entry = ExpertEntry(key[0], key[1], quantized["down"].bits, self.path.name, self.offset, len(blob),
                            len(stored), self.compress, crc32(stored), tensors)
        self.offset = align(self.offset + len(stored), ALIGNMENT)
        return entry

    def finish(self) -> None:
        self.file.truncate(self.offset)  # pad the last blob to a page: aligned reads stay inside the file
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()
