"""The RAM budget chosen for you (ram="auto"): how many bytes of experts the RAM tier may cache, from
the memory this process may still take and what the run holds besides experts (docs/scheduling.md,
"The RAM budget chosen for you").

Two parts: read_memory_facts reads the machine (a cgroup's limit, else /proc/meminfo), and ram_budget
is pure arithmetic on those facts and the run's sizes, so both are tested against hand-made cases.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from .disk import POOL_KEEP

MIB = 1 << 20
# Memory a run takes after its store opens besides dense weights, KV cache, activations and read
# buffers: numba's loaded kernels, torch's workspaces, thread stacks, the code pages they touch.
# Measured with tools/bench_run_memory.py --ram 0 on both bench stores (INT4), kernels cached: VmRSS
# grew 112 and 127 MiB from the load's end to the run's peak, 74 MiB each beyond their read buffers.
RUNTIME_GROWTH = 80 * MIB
# What numba takes to compile the kernels when its cache does not hold them (a first run, a new
# CPU, a changed kernel): kept by the process once compiled. The same measurement on an empty
# NUMBA_CACHE_DIR grew 248 and 248 MiB more (anonymous 243 and 242).
KERNEL_COMPILE_GROWTH = 256 * MIB
# Allocator fragmentation, kernel memory charged to a cgroup (page tables, socket buffers) and
# run-to-run variation (8 MiB between identical runs): a fixed floor plus a share of what is available.
MARGIN_FIXED = 64 * MIB
MARGIN_SHARE = 0.05
# Once a run has shown what it takes (grown_ram_budget), what stays uncertain is smaller: a later step's
# reads above the watched ones', allocator drift, kernel memory. Half the margin's floor, 2% of the limit.
GROWN_MARGIN_FIXED = 32 * MIB
GROWN_MARGIN_SHARE = 0.02
UNLIMITED_V1 = 1 << 60   # cgroup v1 writes "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class MemoryFacts:
    """What this process may still allocate. available: bytes (None: could not be read); source: where
    it came from. Under a cgroup limit: limit, usage (the group's, this process included) and the
    part of usage the kernel reclaims before killing anything (inactive file pages)."""

    available: int | None
    source: str
    limit: int | None = None
    usage: int | None = None
    reclaimable: int | None = None


def ram_budget(facts: MemoryFacts, expert_bytes: int, needs: dict[str, int]) -> tuple[int, dict]:
    """The RAM tier's capacity in bytes and why: available - sum(needs) - margin, within
    [0, expert_bytes]. needs: the run's other holdings by name once loaded (dense, kv_cache,
    activations, read_buffers, runtime; kernel_compile where numba must compile the kernels). The
    cache fills only after the dense weights have loaded (edgemoe.loader.load_store), so the load's
    passing extra (a block of rows being quantized) never meets a full cache. Unknown memory
    (facts.available None): every expert, as an unbounded cache would hold, with the reason in the
    breakdown's "note"."""
    breakdown = {"source": facts.source, "limit": facts.limit, "usage": facts.usage,
                 "reclaimable": facts.reclaimable, "available": facts.available, **needs,
                 "expert_bytes": expert_bytes}
    if facts.available is None:
        breakdown.update(margin=0, budget=expert_bytes,
                         note="free memory could not be read: every expert may be cached")
        return expert_bytes, breakdown
    margin = MARGIN_FIXED + int(MARGIN_SHARE * facts.available)
    room = facts.available - sum(needs.values()) - margin
    budget = min(max(room, 0), expert_bytes)
    breakdown.update(margin=margin, budget=budget)
    if budget == 0:
        breakdown["note"] = "no room for experts: every expert is read from disk when used (slow, but it runs)"
    return budget, breakdown


def grown_ram_budget(facts: MemoryFacts, capacity: int, cached: int, expert_bytes: int, transient: int,
                     future: int) -> tuple[int, dict]:
    """The RAM tier's capacity once a run has shown what it takes (edgemoe.ram_growth.RamGrowth), and
    why: capacity + (available - transient - future - (capacity - cached) - margin), never below
    `capacity` nor above expert_bytes. facts: read now, so their usage holds everything the run keeps
    (dense weights, runtime, compiled kernels, the KV cache so far, the cached experts); cached: the
    tier's bytes now (the rest of its capacity is still to be taken); transient: a step's peak above
    the level between steps, as measured; future: what the run will still add (its KV cache's
    growth); margin: GROWN_MARGIN_FIXED + GROWN_MARGIN_SHARE of the limit (of what is available,
    without one). Unknown memory: unchanged."""
    breakdown = {"available": facts.available, "cached": cached, "transient": transient, "future": future,
                 "capacity_before": capacity}
    if facts.available is None:
        return capacity, {**breakdown, "margin": 0, "grown_by": 0}
    margin = grown_margin(facts)
    room = facts.available - transient - future - (capacity - cached) - margin
    grown = min(max(capacity + room, capacity), max(expert_bytes, capacity))
    return grown, {**breakdown, "margin": margin, "grown_by": grown - capacity}


def grown_margin(facts: MemoryFacts) -> int:
    """The margin kept once a run has shown what it takes (known memory): GROWN_MARGIN_FIXED +
    GROWN_MARGIN_SHARE of the limit (of what is available, without one)."""
    return GROWN_MARGIN_FIXED + int(GROWN_MARGIN_SHARE * (facts.limit or facts.available))


class PeakWatch:
    """This process's resident memory above its level now, at its highest since `reset` (Linux: VmHWM
    reset through /proc/self/clear_refs, then VmHWM - VmRSS). `usable` is False where either cannot be
    done (not Linux, a kernel without clear_refs, a read-only /proc). The reset is the process's: its
    getrusage maximum (what /usr/bin/time reports) counts from it too."""

    def __init__(self, proc: str | os.PathLike = "/proc/self"):
        self.proc = Path(proc)
        self.usable = self.reset()

    def reset(self) -> bool:
        try:
            (self.proc / "clear_refs").write_text("5")   # 5: reset the peak resident set size to the current
        except OSError:
            return False
        return self._status() is not None

    def above_now(self) -> int | None:
        """Bytes the peak since reset lies above the resident set size now (None: unreadable)."""
        status = self._status()
        return None if status is None else max(status["VmHWM"] - status["VmRSS"], 0)

    def _status(self) -> dict[str, int] | None:
        text = _read_text(self.proc / "status") or ""
        fields = {line.split(":")[0]: line.split()[1:] for line in text.splitlines() if ":" in line}
        try:
            return {name: int(fields[name][0]) * 1024 for name in ("VmHWM", "VmRSS")}
        except (KeyError, IndexError, ValueError):
            return None


def read_memory_facts(root: str | os.PathLike = "/") -> MemoryFacts:
    """This process's memory facts under `root` (the file system root; tests pass a fake tree): its
    cgroup's limit where one is set (v2, then v1), else MemAvailable, else unknown (macOS)."""
    root = Path(root)
    for read in (_cgroup_v2, _cgroup_v1):
        facts = read(root)
        if facts is not None:
            return facts
    available = _meminfo_available(root / "proc/meminfo")
    if available is None:
        return MemoryFacts(None, "unknown (no cgroup limit, no /proc/meminfo)")
    return MemoryFacts(available, "/proc/meminfo MemAvailable")


def _cgroup_v2(root: Path) -> MemoryFacts | None:
    group = _group_dir(root, root / "sys/fs/cgroup", "")
    if group is None or not (group / "memory.max").exists():
        return None
    limit = _limit_along(group, root / "sys/fs/cgroup", "memory.max")
    if limit is None:
        return None
    usage = _read_int(group / "memory.current")
    return _under_limit(limit, usage, _stat(group / "memory.stat").get("inactive_file", 0), group)


def _cgroup_v1(root: Path) -> MemoryFacts | None:
    mount = root / "sys/fs/cgroup/memory"
    group = _group_dir(root, mount, "memory")
    if group is None or not (group / "memory.limit_in_bytes").exists():
        return None
    stat = _stat(group / "memory.stat")
    # hierarchical_memory_limit: the smallest limit of this group and its ancestors, the one that bites.
    limits = [x for x in (_read_int(group / "memory.limit_in_bytes"), stat.get("hierarchical_memory_limit"))
              if x is not None]
    if not limits or min(limits) >= UNLIMITED_V1:
        return None
    limit = min(limits)
    usage = _read_int(group / "memory.usage_in_bytes")
    return _under_limit(limit, usage, stat.get("total_inactive_file", stat.get("inactive_file", 0)), group)


def _under_limit(limit: int, usage: int | None, inactive_file: int, group: Path) -> MemoryFacts:
    """Room left under a cgroup limit. Only inactive file pages count as reclaimable: active ones and
    dirty ones the kernel may not free in time, and tmpfs pages (counted as cache) it cannot free at all."""
    usage = usage or 0
    reclaimable = min(inactive_file, usage)
    return MemoryFacts(max(limit - (usage - reclaimable), 0), f"cgroup {group}", limit, usage, reclaimable)


def _group_dir(root: Path, mount: Path, controller: str) -> Path | None:
    """This process's group directory under `mount` from /proc/self/cgroup (line "0::/path" for v2,
    "N:memory:/path" for v1); the mount itself where the path is not under it (a cgroup namespace
    shows its own group as "/")."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controller in controllers.split(",")) if controller else not controllers:
            group = mount / path.lstrip("/")
            return group if group.is_dir() else mount
    return None


def _limit_along(group: Path, mount: Path, name: str) -> int | None:
    """The smallest numeric `name` ("max" is none) of `group` and its ancestors up to `mount`."""
    limits = []
    while True:
        text = _read_text(group / name)
        if text is not None and text != "max":
            limits.append(int(text))
        if group == mount or mount not in group.parents:
            break
        group = group.parent
    return min(limits) if limits else None


def _meminfo_available(path: Path) -> int | None:
    text = _read_text(path)
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _stat(path: Path) -> dict[str, int]:
    pairs = (line.split() for line in (_read_text(path) or "").splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    return int(text) if text is not None and text.isdigit() else None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_buffer_bytes(manifest) -> int:
    """Read buffers held outside the RAM tier's capacity: a whole layer's experts in use by one step
    (a prefill chunk may route to every expert; with a small cache they are read, used, then
    dropped) and the disk tier's pool of released buffers (POOL_KEEP per blob size)."""
    lengths = [e.length for e in manifest.experts.values()]
    if not lengths:
        return 0
    return max(lengths) * (manifest.spec.num_experts + POOL_KEEP * len(set(lengths)))


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). Loading frees the float
    copies of the matrices it quantizes, and glibc keeps such blocks for reuse unless told otherwise:
    bench-qwen3moe's INT4 store on an AVX2 CPU held 853-890 MiB of RSS after load, 502-503 after
    this (tools/bench_load_memory.py). A
    no-op where the C library has no malloc_trim (macOS, musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
