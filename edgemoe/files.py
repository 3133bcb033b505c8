"""Files edgemoe writes (a trace, a plot, a store's manifest and profile, the latency cache): never over
one of the command's inputs, never over an existing file unless asked, and atomically.

    refuse_overwrite(path, inputs, force, "--force")   before any work: OutputError naming the path
    atomic_write(path, content)                        the bytes, all or nothing

atomic_write writes a hidden temporary file beside the destination (same directory, so the same file
system), fsyncs it, renames it over the destination and fsyncs the directory: a reader, a crash or an
interrupt sees the old file whole or the new one whole, never a truncated one, and a failed write
leaves no temporary file behind (a killed process's does stay: `.NAME.<pid>-<random>.tmp`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import IO, Callable, Iterable, Union

from .errors import EdgeMoEError

Content = Union[str, bytes, Callable[[IO], None]]


class OutputError(EdgeMoEError):
    """A destination a command may not write: one of its inputs, an existing file it was not asked to
    replace, a directory, or a path whose directory does not exist."""


def refuse_input(path: str | os.PathLike, inputs: Iterable[str | os.PathLike]) -> None:
    """OutputError if writing `path` could destroy an input: `path` is an input, holds one (a
    directory above it), or is an existing file inside an input directory (a store's manifest...).
    A new file inside an input directory loses nothing and is allowed. Symbolic and hard links are
    followed: a link to an input is that input."""
    path = Path(path)
    target = path.resolve()
    for source in inputs:
        src = Path(source).resolve()
        if target == src or (path.exists() and src.exists() and os.path.samefile(path, src)):
            raise OutputError(f"{path}: is the input {source}; an input is never overwritten, "
                              f"choose another output")
        if target in src.parents:
            raise OutputError(f"{path}: contains the input {source}; choose another output")
        if path.exists() and src in target.parents:
            raise OutputError(f"{path}: is a file of the input {source}; choose another output")


def refuse_overwrite(path: str | os.PathLike, inputs: Iterable[str | os.PathLike], force: bool,
                     force_flag: str) -> None:
    """Check, before any work, that a file may be written at `path`: not an input (refuse_input),
    not an existing file unless `force` (force_flag names it in the message: "--force" on the
    command line, "force=True" from Python), not a directory, in a directory that exists."""
    path = Path(path)
    refuse_input(path, inputs)
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; give a file name")
    if not path.parent.is_dir():
        raise OutputError(f"{path}: cannot be written, no directory {path.parent}")
    if (path.exists() or path.is_symlink()) and not force:
        raise OutputError(f"{path}: already exists (use {force_flag} to replace it)")


def atomic_write(path: str | os.PathLike, content: Content, binary: bool = False) -> None:
    """Write `path` all or nothing. content: text (UTF-8), bytes, or a function given the open
    file that writes it (a text file, or binary with binary=True); whatever it raises propagates,
    with the old file untouched and the temporary file removed."""
    path = Path(path)
    binary = binary or isinstance(content, bytes)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    # O_EXCL: never through a planted link; mode 0o666 less the umask, as open() would make it.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
