#!/usr/bin/env python
"""Disk-tier read speed of a store and the CPU it costs: cold and warm page cache, buffered and
O_DIRECT reads, the checksum's cost, and whether zstd compression of the blobs pays.

    python tools/bench_store_io.py STORE [--experts 64] [--json]

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
import platform
import time
from pathlib import Path

import numpy as np

from edgemoe.store import read_manifest
from edgemoe.store.disk import DiskTier, drop_page_cache
from edgemoe.store.format import crc32


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--experts", type=int, default=64, help="how many experts each pass reads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
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
