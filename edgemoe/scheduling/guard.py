"""Never read more than plain on-demand LRU: the cache measures its own scheme against a ghost.

A scheme (an eviction policy and preloading) pays only if it reads fewer bytes per token than LRU
without preloading would in the same budget; on routing where its predictions are weak (a real
Mixtral's: docs/scheduling.md) it reads more. So a SchemeGuard keeps a ghost LRU cache of the same
byte budget (keys and sizes only), fed every layer's requests, and compares, over windows of
`window_layers` layers, the bytes the real cache read from disk (demand misses and preloads) with
the bytes the ghost would have read. A window worse by more than `margin` steps the scheme down a
level:

    0 "full"        the configured policy and preloading
    1 "no-preload"  the configured policy, no preloads
    2 "lru"         LRU eviction (GuardedPolicy), no preloads: what the ghost does

Time as well as bytes (the runtime store; the simulator has no clock): a preload read in the disk's
idle time costs nothing, one that delays a read the compute waits for costs time whatever the
bytes. So the store also tells the guard (observe_time) how long its callers waited for reads and
how many preloads it loaded. Windows without preloads measure what on-demand reading costs: wait
seconds per byte the ghost reads (`wait_per_byte`; before any such window, the disk's own read
seconds per byte stand in). A window with preloads whose wait exceeds the ghost's bytes at that
cost by more than `time_margin` (plus SLACK_SECONDS per layer, timer noise) is worse too: the
preloads added I/O wait, and preloading turns itself off. Without preloads nothing is judged on
time, so a store without a preloader steps exactly as the simulator does.

At a lower level it probes the level above for one window after `probe_every` windows, and stays
there if that window is not worse; each failed probe doubles the wait (up to MAX_PROBE_GAP windows),
so that a scheme that does not pay costs little more than LRU. Routing that changes its character (a new kind of prompt) is
followed both ways. Both the runtime store (TieredStore) and the simulator (edgemoe/scheduling/simulate.py)
use this class, fed the same way.

With the "adaptive" policy (edgemoe.scheduling.policies) the reference is stricter: not LRU but what
on-demand caching that follows the adaptive policy's best ghost reads (AdaptivePolicy.read_bytes;
LRU is one of its candidates), so preloads are kept only where they beat the best on-demand policy;
and the lowest level is "no-preload", since LRU eviction is already one the policy can follow.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container, Iterable

from .policies import AdaptivePolicy, LRUPolicy

Key = tuple[int, int]
LEVELS = ("full", "no-preload", "lru")
GUARD_WINDOW_TOKENS = 8    # a window of this many tokens' layers: enough requests to compare reads
MAX_PROBE_GAP = 128
SLACK_SECONDS = 1e-4       # per layer of a window: waits this small are timer noise, not the preloads'


class GhostLRU:
    """The reads of on-demand LRU with `budget` bytes, keys and sizes only. As the store, placing an
    expert never evicts one the running layer needs (`pinned`)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.items: OrderedDict[Key, int] = OrderedDict()
        self.bytes = 0
        self.read_bytes = 0

    def request(self, key: Key, nbytes: int, pinned: frozenset = frozenset()) -> None:
        if key in self.items:
            self.items.move_to_end(key)
            return
        self.read_bytes += nbytes
        if nbytes > self.budget:          # streamed, as the store serves an expert larger than a tier
            return
        while self.bytes + nbytes > self.budget:
            victim = next((k for k in self.items if k not in pinned), None)
            if victim is None:            # only pinned experts could make room: served uncached
                return
            self.bytes -= self.items.pop(victim)
        self.items[key] = nbytes
        self.bytes += nbytes


class SchemeGuard:
    def __init__(self, budget: int, window_layers: int, margin: float = 0.02, probe_every: int = 16,
                 time_margin: float = 0.1):
        self.ghost = GhostLRU(budget)
        self.window_layers, self.margin, self.probe_every = window_layers, margin, probe_every
        self.time_margin = time_margin
        self.wait_per_byte: float | None = None   # measured in windows without preloads
        self.slower_windows = 0                   # windows judged worse on time (not on bytes)
        self._wait = self._wait_start = 0.0
        self._preloads = self._preloads_start = 0
        self._read_seconds_per_byte: float | None = None
        self.level = 0
        self.reference: AdaptivePolicy | None = None   # None: the ghost LRU
        self.lowest = len(LEVELS) - 1
        self.changes: list[tuple[int, str]] = []   # (layer calls so far, level entered)
        self._layers = self._window = self._windows_down = 0
        self._real_start = self._ghost_start = 0
        self._probing = False
        self._probe_gap = probe_every

    def measure_against(self, policy) -> None:
        """Judge the scheme guarding `policy` against that policy's own on-demand reads if it is
        adaptive (then never step down to LRU eviction), else against the ghost LRU."""
        if isinstance(policy, AdaptivePolicy):
            self.reference, self.lowest = policy, LEVELS.index("no-preload")

    @property
    def reference_read_bytes(self) -> int:
        return self.ghost.read_bytes if self.reference is None else self.reference.read_bytes

    @property
    def allow_preload(self) -> bool:
        return self.level == 0

    @property
    def use_lru(self) -> bool:
        return self.level == 2

    def observe_time(self, wait_seconds: float, preloads: int, read_seconds_per_byte: float | None) -> None:
        """The store's figures so far (cumulative): seconds its callers waited for reads, preloads
        loaded, and the disk's read seconds per byte (None before any read). Call before observe_layer."""
        self._wait, self._preloads, self._read_seconds_per_byte = wait_seconds, preloads, read_seconds_per_byte

    def observe_layer(self, requests: Iterable[tuple[Key, int]], real_read_bytes: int) -> None:
        """A layer's requests ((key, bytes), in the order the cache serves them) and the bytes the real
        cache has read from disk so far, demand and preloads."""
        if self.reference is None:
            requests = list(requests)
            pinned = frozenset(key for key, _ in requests)
            for key, nbytes in requests:
                self.ghost.request(key, nbytes, pinned - {key})
        self._layers += 1
        self._window += 1
        if self._window >= self.window_layers:
            self._judge(real_read_bytes)

    def _judge(self, real_read_bytes: int) -> None:
        real = real_read_bytes - self._real_start
        ghost = self.reference_read_bytes - self._ghost_start
        slower = self._slower(self._wait - self._wait_start, self._preloads - self._preloads_start, ghost)
        worse = real > ghost * (1 + self.margin) or slower
        self.slower_windows += slower and real <= ghost * (1 + self.margin)
        if self._probing:
            self._probing = False
            if worse:
                self._set(self.level + 1)
                self._probe_gap = min(2 * self._probe_gap, MAX_PROBE_GAP)
            else:
                self._probe_gap = self.probe_every
        elif worse and self.level < self.lowest:
            self._set(self.level + 1)
        elif self.level > 0:
            self._windows_down += 1
            if self._windows_down >= self._probe_gap:
                self._set(self.level - 1)
                self._probing = True
        self._window, self._real_start, self._ghost_start = 0, real_read_bytes, self.reference_read_bytes
        self._wait_start, self._preloads_start = self._wait, self._preloads

    def _slower(self, wait: float, preloads: int, ghost_bytes: int) -> bool:
        """Did this window's preloads make the compute wait longer than reading the ghost's misses
        on demand would have? A window without preloads measures the latter instead."""
        if not preloads:
            if ghost_bytes:
                measured = wait / ghost_bytes
                self.wait_per_byte = measured if self.wait_per_byte is None else (self.wait_per_byte + measured) / 2
            return False
        reference = self.wait_per_byte if self.wait_per_byte is not None else self._read_seconds_per_byte
        if reference is None:
            return False
        return wait > ghost_bytes * reference * (1 + self.time_margin) + SLACK_SECONDS * self.window_layers

    def _set(self, level: int) -> None:
        self.level, self._windows_down = level, 0
        self.changes.append((self._layers, LEVELS[level]))


class GuardedPolicy:
    """A policy and LRU fed the same events; victims come from LRU while the guard says so, so that
    switching loses no history. A guard that never steps down to LRU eviction (an adaptive policy's:
    LRU is one of its candidates) keeps no LRU: it would be fed every event for nothing."""

    def __init__(self, primary, guard: SchemeGuard):
        self.primary, self.guard = primary, guard
        self.lru = LRUPolicy() if guard.lowest >= LEVELS.index("lru") else None
        self.name = primary.name
        self._followers = [p for p in (primary, self.lru) if p is not None]

    def touch(self, key: Key) -> None:
        for policy in self._followers:
            policy.touch(key)

    def insert(self, key: Key) -> None:
        for policy in self._followers:
            policy.insert(key)

    def remove(self, key: Key) -> None:
        for policy in self._followers:
            policy.remove(key)

    def set_capacity(self, capacity: int) -> None:
        self.primary.set_capacity(capacity)

    def set_layer(self, layer: int, needed: Iterable[Key] = ()) -> None:
        self.primary.set_layer(layer, needed)

    def victim(self, candidates: Iterable[Key]) -> Key:
        return (self.lru if self.guard.use_lru else self.primary).victim(candidates)

    def resident_victim(self, pinned: Container[Key]) -> Key | None:
        return (self.lru if self.guard.use_lru else self.primary).resident_victim(pinned)

    def admits(self, probability: float, victim: Key | None) -> bool:
        return self.primary.admits(probability, victim)
