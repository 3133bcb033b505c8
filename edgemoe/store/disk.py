"""The disk tier: one read per expert blob, checksum verified the first time it is read.

io="buffered": pread through the page cache, then posix_fadvise(DONTNEED) on the range, so that a
RAM capacity is not silently doubled by cached file pages (Linux; elsewhere the page cache keeps them).
io="direct": O_DIRECT into a page-aligned buffer (blobs are 4096-aligned and padded for this);
falls back to buffered where the file system refuses O_DIRECT (tmpfs, macOS).
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np

from .format import ALIGNMENT, ExpertEntry, Manifest, StoreError, align, crc32

IO_MODES = ("buffered", "direct")


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

    def __init__(self, manifest: Manifest, io: str = "buffered"):
        if io not in IO_MODES:
            raise StoreError(f"io={io!r}: expected one of {IO_MODES}")
        self.manifest = manifest
        self.io = io
        self._fds: dict[str, int] = {}
        self._direct = io == "direct" and hasattr(os, "O_DIRECT")
        self._verified: set[tuple[str, int]] = set()    # (file, offset) of the blobs checked
        self._lock = threading.Lock()
        self.reads = 0
        self.read_seconds = 0.0   # wall time of reads, checksum included: the preloader's I/O estimate

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
        start = time.perf_counter()
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
        if entry.compression == "zstd":
            import zstandard
            raw = zstandard.ZstdDecompressor().decompress(bytes(stored), max_output_size=entry.length)
            return np.frombuffer(bytearray(raw), dtype=np.uint8)
        return stored

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
        size = align(entry.stored_length, ALIGNMENT)
        page_aligned = mmap.mmap(-1, size)  # anonymous mappings are page-aligned, as O_DIRECT needs
        got = os.preadv(fd, [page_aligned], entry.offset)
        if got < entry.stored_length:
            raise StoreError(f"{self.manifest.path / entry.file}: short read for {entry.where()} "
                             f"({got} of {entry.stored_length} bytes): truncated file")
        return np.frombuffer(page_aligned, dtype=np.uint8, count=entry.stored_length)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
