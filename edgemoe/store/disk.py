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
from typing import Callable

import numpy as np

from .format import ALIGNMENT, ExpertEntry, Manifest, StoreError, align, crc32

IO_MODES = ("direct", "buffered")
POOL_KEEP = 2    # released buffers kept per blob size of the store: the pool's only memory beyond the RAM tier
CHUNK = 1 << 20  # a preload reads in chunks of this many bytes and pauses between them while demand waits


class BufferPool:
    """Page-aligned read buffers, recycled across sizes: a buffer released when its expert left the
    cache is handed out again only once nothing refers to it (CPython's reference count: every numpy
    view of an expert's arrays keeps its buffer alive), so a buffer a computation still reads is never
    overwritten. Any released buffer at least as large as asked for serves, the smallest such (best
    fit), so that fallback copies, the widths of a budget store and full experts share one pool; the
    pages past what the read needs are given back to the kernel (madvise DONTNEED), so a large buffer
    serving a small read holds the small read's memory only. At most `keep` released buffers wait
    for reuse, the oldest dropped first."""

    def __init__(self, keep: int = POOL_KEEP):
        self.keep = keep
        self._released: deque[mmap.mmap] = deque()
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, size: int) -> mmap.mmap:
        """A buffer of at least `size` bytes (its first `size` bytes are the ones to read into)."""
        with self._lock:
            best = None
            for i in range(len(self._released)):
                # 2 references: the deque's and getrefcount's argument; any view of it adds one.
                length = len(self._released[i])
                if (length >= size and sys.getrefcount(self._released[i]) == 2
                        and (best is None or length < len(self._released[best]))):
                    best = i
            if best is not None:
                buffer = self._released[best]
                del self._released[best]
                self.reused += 1
                _give_back_tail(buffer, size)
                return buffer
            self.allocated += 1
        return _anonymous(size)

    def release(self, buffer: mmap.mmap) -> None:
        with self._lock:
            self._released.append(buffer)
            if len(self._released) > self.keep:
                self._released.popleft()

    def clear(self) -> None:
        """Drop every released buffer (a closed store's)."""
        with self._lock:
            self._released.clear()


def _anonymous(size: int) -> mmap.mmap:
    """Page-aligned memory, as O_DIRECT needs; private, so that madvise(DONTNEED) frees its pages
    (a shared anonymous mapping, mmap's default, keeps them in shared memory)."""
    if hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, size)


def _give_back_tail(buffer: mmap.mmap, used: int) -> None:
    """Free the physical pages of `buffer` past its first `used` bytes (zero pages if touched again)."""
    start = align(used, mmap.PAGESIZE)
    if start < len(buffer) and hasattr(mmap, "MADV_DONTNEED"):
        buffer.madvise(mmap.MADV_DONTNEED, start, len(buffer) - start)


class _Pauses:
    """A read's pause hook and the time spent in it (not counted as reading)."""

    def __init__(self, pause: Callable[[], None] | None):
        self.pause, self.seconds = pause, 0.0

    def __call__(self) -> None:
        start = time.perf_counter()
        self.pause()
        self.seconds += time.perf_counter() - start


def _read_chunks(fd: int, view: memoryview, offset: int, pause: _Pauses) -> int:
    """pread `view` from `offset`, whole, or in CHUNK-byte parts with a pause between them (chunks
    are multiples of the page size, as O_DIRECT needs); the bytes read (fewer at the end of the file)."""
    step = CHUNK if pause.pause is not None else len(view)
    got = 0
    for start in range(0, len(view), step):
        if start:
            pause()
        chunk = view[start:start + step]
        n = os.preadv(fd, [chunk], offset + start)
        got += n
        if n < len(chunk):
            break
    return got


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
        sizes = {align(e.stored_length, ALIGNMENT) for e in (*manifest.experts.values(), *manifest.fallback.values())}
        self.pool = BufferPool(keep=POOL_KEEP * max(1, len(sizes)))
        self._verified: set[tuple[str, int]] = set()    # (file, offset) of the blobs checked
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes_read = 0
        self.read_seconds = 0.0   # wall time of reads, checksum included, pauses not: the preloader's I/O estimate
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

    def read(self, entry: ExpertEntry, pause: Callable[[], None] | None = None) -> np.ndarray:
        """The expert's blob (decompressed): uint8 [entry.length], owned by the caller. pause: read
        in chunks of CHUNK bytes and call it between them (a preload lets demand reads go first)."""
        start, cpu = time.perf_counter(), time.thread_time()
        with self._lock:
            fd = self._fd(entry.file)
            direct = self._direct
        paused = _Pauses(pause)
        stored = self._read_direct(fd, entry, paused) if direct else self._read_buffered(fd, entry, paused)
        key = entry.file, entry.offset     # an expert and its fallback copy are two blobs
        if key not in self._verified:
            if crc32(stored) != entry.crc32:
                raise StoreError(f"{self.manifest.path / entry.file}: checksum mismatch for {entry.where()}: "
                                 "the store is corrupt")
            with self._lock:
                self._verified.add(key)
        with self._lock:
            self.reads += 1
            self.bytes_read += entry.stored_length
            self.read_seconds += time.perf_counter() - start - paused.seconds
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

    def _read_buffered(self, fd: int, entry: ExpertEntry, pause: _Pauses) -> np.ndarray:
        buf = np.empty(entry.stored_length, dtype=np.uint8)
        got = _read_chunks(fd, memoryview(buf), entry.offset, pause)
        if got != entry.stored_length:
            raise StoreError(f"{self.manifest.path / entry.file}: short read for {entry.where()} "
                             f"({got} of {entry.stored_length} bytes): truncated file")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, entry.offset, entry.stored_length, os.POSIX_FADV_DONTNEED)
        return buf

    def _read_direct(self, fd: int, entry: ExpertEntry, pause: _Pauses) -> np.ndarray:
        size = align(entry.stored_length, ALIGNMENT)
        buffer = self.pool.take(size)
        got = _read_chunks(fd, memoryview(buffer)[:size], entry.offset, pause)
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
        self.pool.clear()
