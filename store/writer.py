"""`edgemoe convert`: a Hugging Face checkpoint -> a store (docs/store-format.md), atomically.

Tensors stream through: dense weights are copied one at a time into dense.safetensors, experts are
read, quantized (a bounded number in flight, in parallel) and appended to the data file in
(layer, expert) order, so peak memory is a few experts plus one dense tensor. Everything is written
into STORE.partial-<pid>; the manifest is written last and the directory renamed into place.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


import edgemoe
from edgemoe.checkpoint import Checkpoint, write_safetensors
from edgemoe.loader import read_spec
from edgemoe.models import architecture
from edgemoe.models.spec import ModelSpec
from edgemoe.quant import quantize
from edgemoe.weights import plan_weights, read_expert

from .format import (ALIGNMENT, ARRAY_ALIGNMENT, COPIED_FILES, DENSE_FILE, EXPERT_ROLES, FORMAT_NAME,
                     FORMAT_VERSION, MANIFEST, StoreError, align, crc32, encode_blob, write_json_atomic)

DATA_FILE = "experts-00000.bin"


@dataclass
class ConvertReport:
    store: Path
    experts: int
    expert_bytes: int
    dense_bytes: int
    expert_params: int
    seconds: float
    peak_rss_bytes: int
    widths: dict[int, int] = field(default_factory=dict)   # bits -> number of experts

    @property
    def bits_per_weight(self) -> float:
        """Stored expert bits (codes, scales and zeros) per expert weight."""
        return 8 * self.expert_bytes / self.expert_params


def read_widths(path: str | os.PathLike, spec: ModelSpec) -> dict[tuple[int, int], int]:
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
    """Refuse, before any work, a destination whose replacement could lose data: `out` may exist only
    with `force` and only as a store (a directory with a manifest); it may not be, hold or lie inside
    an input of the command (the checkpoint, a calibration text...). Nothing is touched here."""
    out = Path(out)
    target = out.resolve()
    for source in inputs:
        src = Path(source).resolve()
        if src == target or target in src.parents:
            raise StoreError(f"{out}: is or contains the input {source}; choose another output directory")
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise StoreError(f"{out}: already exists (use --force to replace a store)")
    if out.is_symlink() or not out.is_dir() or not (out / MANIFEST).is_file():
        raise StoreError(f"{out}: not an edgemoe store (no {MANIFEST}); --force replaces only a store, "
                         f"so it was left untouched")


def _stale_partials(out: Path) -> list[Path]:
    return list(out.parent.glob(out.name + ".partial-*"))


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_dense(ckpt: Checkpoint, dense_names: dict[str, str], path: Path) -> int:
    """Stream the dense tensors into a safetensors file under canonical names; returns its crc32."""
    items = [(role, ckpt.tensors[name].dtype, ckpt.tensors[name].shape, lambda name=name: ckpt.get(name))
             for role, name in sorted(dense_names.items())]
    return write_safetensors(path, items)


def _quantize_expert(ckpt: Checkpoint, source, bits: int, group_size: int | None, method: str):
    weights = read_expert(ckpt, source)
    return {role: quantize(weights[role], bits, group_size, method) for role in EXPERT_ROLES}


def convert(model_dir: str | os.PathLike, out: str | os.PathLike, bits: int = 4,
            widths: dict[tuple[int, int], int] | None = None, group_size: int | None = None,
            method: str = "rtn", compress: str | None = None, force: bool = False, workers: int | None = None,
            on_progress: Callable[[int, int], None] | None = None, extra: dict | None = None) -> ConvertReport:
    """Convert a checkpoint directory into a store at `out`. `widths` overrides `bits` per (layer, expert);
    `extra` adds top-level manifest sections (e.g. the budget search's record)."""
    if compress not in (None, "zstd"):
        raise StoreError(f"--compress {compress!r}: expected zstd or nothing")
    start = time.perf_counter()
    out = Path(out)
    check_destination(out, force, inputs=[Path(model_dir)])
    ckpt = Checkpoint(model_dir)
    spec = read_spec(ckpt)
    plan = plan_weights(ckpt, spec, architecture(spec.model_type).tensor_names(spec))
    widths = {key: (widths or {}).get(key, bits) for key in plan.experts}
    for stale in _stale_partials(out):
        shutil.rmtree(stale, ignore_errors=True)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        for name in COPIED_FILES:
            if (ckpt.path / name).exists():
                shutil.copyfile(ckpt.path / name, partial / name)
        dense_crc = write_dense(ckpt, plan.dense, partial / DENSE_FILE)
        entries, expert_bytes, expert_params = _write_experts(ckpt, plan, widths, group_size, method, compress,
                                                              partial / DATA_FILE, workers, on_progress)
        manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "complete": True,
            "created_by": f"edgemoe {edgemoe.__version__}",
            "source": {"path": str(Path(model_dir).resolve()), "model_type": spec.model_type},
            "spec": spec.to_dict(), "alignment": ALIGNMENT, "checksum": "crc32",
            "dense": {"file": DENSE_FILE, "size": (partial / DENSE_FILE).stat().st_size, "crc32": dense_crc},
            "quantization": {"method": method, "group_size": group_size, "array_alignment": ARRAY_ALIGNMENT},
            "data_files": [{"name": DATA_FILE, "size": (partial / DATA_FILE).stat().st_size}],
            "experts": [e.to_json() for e in entries],
            **(extra or {}),
        }
        write_json_atomic(partial / MANIFEST, manifest)
        _fsync_path(partial)
        if out.exists():  # --force: the old store goes only once the new one is complete
            trash = out.with_name(f"{out.name}.old-{os.getpid()}")
            os.replace(out, trash)
            os.replace(partial, out)
            shutil.rmtree(trash)
        else:
            os.replace(partial, out)
        _fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        ckpt.close()
    counts: dict[int, int] = {}
    for b in widths.values():
        counts[b] = counts.get(b, 0) + 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return ConvertReport(out, len(entries), expert_bytes, manifest["dense"]["size"], expert_params,
                         time.perf_counter() - start, peak, dict(sorted(counts.items())))


def _write_experts(ckpt, plan, widths, group_size, method, compress, path: Path, workers, on_progress):
    from .format import ExpertEntry

    compressor = None
    if compress == "zstd":
        import zstandard
        compressor = zstandard.ZstdCompressor(level=3)
    keys = sorted(plan.experts)
    workers = workers or os.cpu_count() or 1
    entries, offset, total_bytes, params = [], 0, 0, 0
    with open(path, "wb") as f, ThreadPoolExecutor(workers) as pool:
        pending = []
        for i, key in enumerate(keys + [None] * (workers + 1)):
            if key is not None:  # keep at most workers + 1 experts in flight: bounded memory
                pending.append((key, pool.submit(_quantize_expert, ckpt, plan.experts[key], widths[key],
                                                 group_size, method)))
            if len(pending) > workers or (key is None and pending):
                done_key, future = pending.pop(0)
                quantized = future.result()
                tensors, blob = encode_blob(quantized)
                stored = compressor.compress(blob) if compressor else blob
                f.seek(offset)
                f.write(stored)
                entries.append(ExpertEntry(done_key[0], done_key[1], widths[done_key], path.name, offset, len(blob),
                                           len(stored), compress, crc32(stored), tensors))
                total_bytes += len(stored)
                params += sum(q.shape[0] * q.shape[1] for q in quantized.values())
                offset = align(offset + len(stored), ALIGNMENT)
                if on_progress:
                    on_progress(len(entries), len(keys))
        f.truncate(offset)  # pad the last blob to a page: aligned reads stay inside the file
        f.flush()
        os.fsync(f.fileno())
    return entries, total_bytes, params
