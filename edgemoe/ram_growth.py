"""--ram auto's second look: grow the RAM tier once, from what a run has shown it takes.

When a store opens, --ram auto can only estimate what the run will hold besides experts, and keeps a
margin for what it cannot know (docs/scheduling.md, "The RAM budget chosen for you"). Once one
sequence is decoding and the RAM tier is full, most of that is in the memory the process is charged
for: the dense weights, the runtime, compiled kernels, the cached experts at their real size. What
a decode step takes above that level (its read buffers and activations) is measured over a few steps
(PeakWatch); the KV cache's growth to the sequence's last token is known. RamGrowth then reads the
memory facts again and grows the tier once by what is left (grown_ram_budget), for the rest of
that sequence: when it ends, the tier returns to its first size, so that another prompt's prefill
(a chat's next turn, another generate() call) finds the reserves the budget was chosen with.

Only plain decoding of one sequence looks twice (edgemoe.generate.decode: `edgemoe run`, `chat`'s
turns, generate(); and `edgemoe bench`, which measures that): its later steps are like the watched
ones. Serving, batches and beams keep the budget chosen at open, since a later step may prefill
another prompt or hold more sequences. Which experts are cached never changes a result (the tiering
invariant), only the time.
"""

from __future__ import annotations

from .kv_cache import KVCache
from .store.memory import PeakWatch, grown_ram_budget, read_memory_facts

# Decode steps watched, once the RAM tier is full, for the highest a step takes above the level
# between steps: several steps, since each misses a different number of experts, and few enough
# that the tier grows early in a run (at the 9th to 16th token in the runs of docs/scheduling.md).
GROWTH_WATCH_STEPS = 8


class RamGrowth:
    """The second look for a store opened with ram="auto", decoding one sequence. Call after_step()
    after each decode step: it grows the store's RAM tier at most once and records why in
    store.ram_breakdown["grown"]; end() when the sequence ends returns the tier to its first size."""

    def __init__(self, store, watch: PeakWatch, memory_root: str = "/"):
        self.store, self.watch, self.memory_root = store, watch, memory_root
        self.largest = max(e.length for e in store.manifest.experts.values())
        self.watched: int | None = None     # decode steps watched since the tier was full
        self.done = False
        self.first_capacity: int | None = None   # the tier's size before it grew, until end()

    @classmethod
    def for_store(cls, store, memory_root: str = "/", proc: str = "/proc/self") -> "RamGrowth | None":
        """A second look for `store`, or None where there is nothing to grow: no store, a RAM budget
        not chosen by auto, a VRAM tier, one that holds every expert, memory that cannot be read, a
        peak that cannot be measured."""
        breakdown = getattr(store, "ram_breakdown", None)
        if not breakdown or breakdown.get("available") is None or store.vram_capacity:
            return None
        if store.ram_capacity >= store.manifest.expert_bytes:
            return None
        watch = PeakWatch(proc)
        return cls(store, watch, memory_root) if watch.usable else None

    def after_step(self, tokens: int, state, last_position: int) -> None:
        """After a decode step: `tokens` decoded so far; `state` the sequence's decoding state, whose
        growth up to `last_position` (its final length) stays reserved: a KVCache's as it will
        allocate it, any other's (an encoder-decoder's) as auto reserved it when the store opened."""
        if self.done:
            return
        cached, capacity = self.store.ram_filled()
        if self.watched is None:
            if capacity - cached >= self.largest:
                return                      # still filling: what it will hold is not in memory yet
            self.watch.reset()
            self.watched = 0
            return
        self.watched += 1
        if self.watched >= GROWTH_WATCH_STEPS:
            future = (state.growth_to(last_position) if isinstance(state, KVCache)
                      else self.store.ram_breakdown.get("kv_cache", 0))
            self._grow(cached, capacity, future, tokens)

    def _grow(self, cached: int, capacity: int, future: int, tokens: int) -> None:
        self.done = True
        transient = self.watch.above_now()
        if transient is None:
            return
        grown, why = grown_ram_budget(read_memory_facts(self.memory_root), capacity, cached,
                                      self.store.manifest.expert_bytes, transient, future)
        if grown > capacity:
            self.store.resize_ram(grown)
            self.first_capacity = capacity
        self.store.ram_breakdown["grown"] = {**why, "after_tokens": tokens}

    def end(self) -> None:
        """The sequence ended: the tier returns to its first size, so that a later prompt's prefill
        finds the reserves it was sized with (the room grown was this sequence's decode's)."""
        if self.first_capacity is not None:
            self.store.resize_ram(self.first_capacity)
            self.first_capacity = None
