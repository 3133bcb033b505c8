"""The disk tier: one read per expert blob, checksum verified the first time it is read.

io="direct" (the default): O_DIRECT into a page-aligned buffer (blobs are 4096-aligned and padded
for this), the buffer taken from a BufferPool that recycles the buffers of experts that left the
cache; falls back to buffered where the file system refuses O_DIRECT (tmpfs, macOS).
io="buffered": pread through the page cache, then posix_fadvise(DONTNEED) on the range, so that a
RAM capacity is not silently doubled by cached file pages (Linux; elsewhere the page cache keeps them).
Why direct and pooled: per GB read it cost the reading thread 69 ms of CPU against 593 ms for
buffered reads and 1,053 ms for O_DIRECT into a fresh buffer (the kernel's page-cache work and
copy; the new pages' faults), and it read fastest (docs/benchmarks.md, "Store I/O").
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections import deque

import numpy as np

from .format import ALIGNMENT, ExpertEntry, Manifest, StoreError, align, crc32

IO_MODES = ("direct", "buffered")
POOL_KEEP = 2    # released buffers kept per size: the only memory the pool holds beyond the RAM tier


class BufferPool:
    """Page-aligned read buffers, recycled: a buffer released when its expert left the cache is
    handed out again only once nothing refers to it (CPython's reference count: every numpy view of
    an expert's arrays keeps its buffer alive), so a buffer a computation still reads is never
    overwritten. Buffers are reused at their exact size; at most `keep` released buffers of each
    size wait for reuse (a store's blobs come in a few sizes: one per width, and the fallback copies')."""

    def __init__(self, keep: int = POOL_KEEP):
        self.keep = keep
        self._released: dict[int, deque[mmap.mmap]] = {}
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            released = self._released.get(size, ())
            for i in range(len(released)):
                # 2 references: the deque's and getrefcount's argument; any view of it adds one.
                if sys.getrefcount(released[i]) == 2:
                    buffer = released[i]
                    del released[i]
                    self.reused += 1
                    return buffer
            self.allocated += 1
        return mmap.mmap(-1, size)   # anonymous mappings are page-aligned, as O_DIRECT needs

    def release(self, buffer: mmap.mmap) -> None:
        with self._lock:
            released = self._released.setdefault(len(buffer), deque())
            released.append(buffer)
            if len(released) > self.keep:
                released.popleft()


def drop_page_cache(path) -> None:
    """Write back, then drop the file's pages from the page cache (Linux; a no-op elsewhere)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class DiskTier:
    """Reads of expert blobs, each checked against its CRC-32 the first time it is read."""

    def __init__(self, manifest: Manifest, io: str = "direct"):
        if io not in IO_MODES:
            raise StoreError(f"io={io!r}: expected one of {IO_MODES}")
        self.manifest = manifest
        self.io = io
        self._fds: dict[str, int] = {}
        self._direct = io == "direct" and hasattr(os, "O_DIRECT")
        self.pool = BufferPool()
        self._verified: set[tuple[str, int]] = set()    # (file, offset) of the blobs checked
        self._lock = threading.Lock()
        self.reads = 0
        self.read_seconds = 0.0   # wall time of reads, checksum included: the preloader's I/O estimate
        self.read_cpu_seconds = 0.0   # CPU time of the reading threads in reads (kernel copies included)

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            path = self.manifest.path / name
            flags = os.O_RDONLY | (os.O_DIRECT if self._direct else 0)
            try:
                fd = os.open(path, flags)
            except OSError:
                if not self._direct:
                    raise
                self._direct = False  # the file system refuses O_DIRECT: read through the page cache
                fd = os.open(path, os.O_RDONLY)
            self._fds[name] = fd
        return fd

    def read(self, entry: ExpertEntry) -> np.ndarray:
        """The expert's blob (decompressed): uint8 [entry.length], owned by the caller."""
        start, cpu = time.perf_counter(), time.thread_time()
        with self._lock:
            fd = self._fd(entry.file)
            direct = self._direct
        stored = self._read_direct(fd, entry) if direct else self._read_buffered(fd, entry)
        key = entry.file, entry.offset     # an expert and its fallback copy are two blobs
        if key not in self._verified:
            if crc32(stored) != entry.crc32:
                raise StoreError(f"{self.manifest.path / entry.file}: checksum mismatch for {entry.where()}: "
                                 "the store is corrupt")
            with self._lock:
                self._verified.add(key)
        with self._lock:
            self.reads += 1
            self.read_seconds += time.perf_counter() - start
            self.read_cpu_seconds += time.thread_time() - cpu
        if entry.compression == "zstd":
            import zstandard
            raw = zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=entry.length)
            self.release(stored)
            return np.frombuffer(bytearray(raw), dtype=np.uint8)
        return stored

    def reads_within(self, seconds: float | None) -> float | None:
        """How many reads fit in `seconds` at the mean time of the reads so far (what the preloader's
        and a speculative draft's prefetch may issue); None before any read, or for no time given."""
        if seconds is None or self.reads == 0:
            return None
        return seconds / (self.read_seconds / self.reads)

    def release(self, blob: np.ndarray) -> None:
        """`blob` (a read's result) is no longer cached: its buffer may be reused once unreferenced."""
        buffer = getattr(blob.base, "obj", None)    # a pooled read: array -> memoryview -> mmap
        if isinstance(buffer, mmap.mmap):
            self.pool.release(buffer)

    def _read_buffered(self, fd: int, entry: ExpertEntry) -> np.ndarray:
        buf = np.empty(entry.stored_length, dtype=np.uint8)
        got = os.preadv(fd, [memoryview(buf)], entry.offset)
        if got != entry.stored_length:
            raise StoreError(f"{self.manifest.path / entry.file}: short read for {entry.where()} "
                             f"({got} of {entry.stored_length} bytes): truncated file")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, entry.offset, entry.stored_length, os.POSIX_FADV_DONTNEED)
        return buf

    def _read_direct(self, fd: int, entry: ExpertEntry) -> np.ndarray:
        buffer = self.pool.take(align(entry.stored_length, ALIGNMENT))
        got = os.preadv(fd, [buffer], entry.offset)
        if got < entry.stored_length:
            self.pool.release(buffer)
            raise StoreError(f"{self.manifest.path / entry.file}: short read for {entry.where()} "
                             f"({got} of {entry.stored_length} bytes): truncated file")
        return np.frombuffer(buffer, dtype=np.uint8, count=entry.stored_length)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
