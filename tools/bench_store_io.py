#!/usr/bin/env python
"""Disk-tier read speed of a store and the CPU it costs: cold and warm page cache, buffered and
O_DIRECT reads, the checksum's cost, and whether zstd compression of the blobs pays.

    python tools/bench_store_io.py STORE [--experts 64] [--json]
    python tools/bench_store_io.py STORE --in-flight [--depths 1 2 4 8] [--sizes-mb 0.6 2.4 5.6 32] [--repeats 3]

--in-flight measures reads in flight instead (docs/scheduling.md, "Reads in flight and demand
first"): (1) raw O_DIRECT throughput against the number of reads in flight (reader threads, each
pread-ing into its own page-aligned buffer) and the read size, at random 4 KiB-aligned offsets of the
store's largest data file; (2) a layer's misses read through the store as the runtime reads them:
TieredStore(ram=0, readers=N) with a layer's experts submitted together (prefetch urgent, then get
each), against the caller reading them one by one (readers unused), a fresh store per pass so that
every read is a first read with its checksum. Settings are interleaved in random order within each
repeat; figures are medians over repeats. O_DIRECT bypasses the page cache: no root needed to be cold.

CPU: the reading thread's CPU time (user + system: the kernel's copies, page faults and page-cache
work are charged to it) per GB read, the cost a background read takes from the compute on a
machine with few cores. Each blob is released right after its read, as an eviction releases it, so
O_DIRECT reads reuse the disk tier's pooled buffers; "direct, fresh buffers" turns the pool off
(a new buffer per read, whose pages the kernel must fault in and zero).

Cold: posix_fadvise(DONTNEED) empties the page cache of the data file before each pass (measured:
it does on Linux). Each pass reads the same experts through DiskTier.read; an
expert's checksum is verified on its first read only ("first read (crc)" vs later passes); "crc32" is the checksum alone on bytes in memory. Buffered
reads drop the pages they read from the cache (the RAM tier is the cache; see edgemoe/store/disk.py), so
"buffered warm" measures that policy, not a warm page cache. zstd: the compression ratio r of the
sampled blobs and the decompression speed z: compression pays when a disk of bandwidth B reads the
smaller blob and decompresses it faster than it reads the raw one, 1 / (r B) + 1 / z < 1 / B, i.e.
B < z (1 - 1/r).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from edgemoe.store import open_store, read_manifest
from edgemoe.store.disk import DiskTier, drop_page_cache
from edgemoe.store.format import ALIGNMENT, crc32


def read_pass(tier: DiskTier, entries, cold: bool) -> tuple[float, float]:
    """(GB/s, CPU seconds per GB) reading `entries` once through `tier` (checksums verified on each
    expert's first read)."""
    if cold:
        for name in {e.file for e in entries}:
            drop_page_cache(tier.manifest.path / name)
    start, cpu = time.perf_counter(), time.thread_time()
    for e in entries:
        tier.release(tier.read(e))    # as an eviction would: a pooled buffer is reused by a later read
    return _rates(sum(e.stored_length for e in entries), time.perf_counter() - start, time.thread_time() - cpu)


def _rates(nbytes: int, seconds: float, cpu_seconds: float) -> tuple[float, float]:
    return nbytes / seconds / 1e9, cpu_seconds / (nbytes / 1e9)


def raw_pass(path: Path, size: int, depth: int, total: int, rng: random.Random) -> float:
    """GB/s of O_DIRECT preads of `size` bytes at random aligned offsets of `path`, `depth` in flight."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        span = (os.fstat(fd).st_size - size) // ALIGNMENT
        offsets = [rng.randrange(span) * ALIGNMENT for _ in range(max(2 * depth, total // size))]
        count, lock = len(offsets), threading.Lock()

        def reader():
            buffer = mmap.mmap(-1, size)
            while True:
                with lock:
                    if not offsets:
                        return
                    offset = offsets.pop()
                os.preadv(fd, [buffer], offset)

        threads = [threading.Thread(target=reader) for _ in range(depth)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return count * size / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)


def layer_pass(store: Path, readers: int, layers: list[int], submit: bool) -> float:
    """Seconds per layer to read every expert of each of `layers` through a fresh store with no RAM:
    submitted together to `readers` reader threads (submit) or read by the caller one by one."""
    with open_store(store, ram=0, readers=readers, place_popular=False, guard=False) as s:
        experts = s.spec.num_experts
        start = time.perf_counter()
        for layer in layers:
            keys = [(layer, e) for e in range(experts)]
            s.begin_layer(layer, needed=keys)
            if submit:
                s.prefetch(keys, urgent=True)
            for key in keys:
                s.get(*key)
        return (time.perf_counter() - start) / len(layers)


def in_flight(args) -> dict:
    manifest = read_manifest(args.store)
    data = max((manifest.path / name for name in {e.file for e in manifest.experts.values()}),
               key=lambda path: path.stat().st_size)
    sizes = [int(mb * 1e6) // ALIGNMENT * ALIGNMENT for mb in args.sizes_mb]
    layer_ids = sorted({e.layer for e in manifest.experts.values()})
    settings = [("raw", size, depth) for size in sizes for depth in args.depths] + [
        ("layer", None, 0)] + [("layer", None, depth) for depth in args.depths]
    rng, results = random.Random(0), {}
    for repeat in range(args.repeats):
        rng.shuffle(settings)
        layers = layer_ids[repeat::args.repeats][:4] or layer_ids[:4]   # other experts each repeat
        for kind, size, depth in settings:
            value = (raw_pass(data, size, depth, args.raw_mb << 20, rng) if kind == "raw"
                     else layer_pass(args.store, max(1, depth), layers, submit=depth > 0))
            results.setdefault((kind, size, depth), []).append(value)
    expert_mb = max(e.stored_length for e in manifest.experts.values()) / 1e6
    return {"store": str(args.store), "expert_mb": expert_mb, "experts_per_layer": manifest.spec.num_experts,
            "load_average": os.getloadavg(),
            "raw_gbps": {f"{size / 1e6:.2f} MB, {depth} in flight": statistics.median(results[("raw", size, depth)])
                         for size in sizes for depth in args.depths},
            "layer_ms": {("caller reads one by one" if depth == 0 else f"submitted together, {depth} readers"):
                         1000 * statistics.median(results[("layer", None, depth)]) for depth in [0, *args.depths]}}


def print_in_flight(record: dict) -> None:
    print(f"{record['store']}: load average {record['load_average'][0]:.2f}")
    print("raw O_DIRECT reads, GB/s:")
    for name, gbps in record["raw_gbps"].items():
        print(f"  {name:26} {gbps:6.2f}")
    print(f"a layer's {record['experts_per_layer']} experts of {record['expert_mb']:.2f} MB, first reads, "
          "ms per layer:")
    for name, ms in record["layer_ms"].items():
        print(f"  {name:32} {ms:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--experts", type=int, default=64, help="how many experts each pass reads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--in-flight", action="store_true", help="reads in flight against depth and size instead")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.6, 2.4, 5.6, 32])
    parser.add_argument("--raw-mb", type=int, default=96, help="MiB read per raw pass")
    args = parser.parse_args()
    if args.in_flight:
        record = in_flight(args)
        print(json.dumps(record, indent=1)) if args.json else print_in_flight(record)
        return
    manifest = read_manifest(args.store)
    entries = sorted(manifest.experts.values(), key=lambda e: (e.file, e.offset))
    step = max(1, len(entries) // args.experts)
    sample = entries[::step][:args.experts]   # spread over the file, read in file order
    results, cpu = {}, {}

    def record(name, passes):
        results[name] = float(np.median([gbps for gbps, _ in passes]))
        cpu[name] = float(np.median([seconds for _, seconds in passes]))

    for io in ("buffered", "direct"):
        record(f"{io} cold, first read (crc)",
               [read_pass(DiskTier(manifest, io=io), sample, cold=True) for _ in range(args.repeats)])
        tier = DiskTier(manifest, io=io)
        read_pass(tier, sample, cold=True)                       # checksums verified once
        for cold in (True, False):
            record(f"{io} {'cold' if cold else 'warm'}", [read_pass(tier, sample, cold) for _ in range(args.repeats)])
        tier.close()
    tier = DiskTier(manifest, io="direct")
    tier.pool.keep = 0
    read_pass(tier, sample, cold=True)
    record("direct cold, fresh buffers", [read_pass(tier, sample, cold=True) for _ in range(args.repeats)])
    tier = DiskTier(manifest)
    blobs = [tier.read(e) for e in sample[:16]]
    start, thread = time.perf_counter(), time.thread_time()
    for b in blobs:
        crc32(b)
    results["crc32 in memory"], cpu["crc32 in memory"] = _rates(sum(b.nbytes for b in blobs),
                                                                time.perf_counter() - start, time.thread_time() - thread)
    import zstandard
    compressed = [zstandard.ZstdCompressor(level=3).compress(b.tobytes()) for b in blobs]
    ratio = sum(b.nbytes for b in blobs) / sum(len(c) for c in compressed)
    start = time.perf_counter()
    for c in compressed:
        zstandard.ZstdDecompressor().decompress(c)
    results["zstd decompress (output)"] = sum(b.nbytes for b in blobs) / (time.perf_counter() - start) / 1e9
    sampled = sum(e.stored_length for e in sample)
    record = {"store": str(args.store), "machine": platform.platform(), "experts_read": len(sample),
              "bytes_per_pass": sampled, "gbps": results, "cpu_seconds_per_gb": cpu, "zstd_ratio": ratio}
    if args.json:
        print(json.dumps(record, indent=1))
        return
    print(f"{args.store}: {len(sample)} experts per pass ({sampled / 1e6:.1f} MB), median of {args.repeats}")
    for name, gbps in results.items():
        cost = f"   {1000 * cpu[name]:6.0f} CPU ms per GB" if name in cpu else ""
        print(f"  {name:31} {gbps:7.2f} GB/s{cost}")
    print(f"  {'zstd level 3 ratio':31} {ratio:7.3f}")


if __name__ == "__main__":
    main()
