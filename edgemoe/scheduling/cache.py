"""ExpertCache: which experts are resident where, and what to evict; no I/O, no threads.

The runtime store (edgemoe.store.TieredStore) and the simulator (edgemoe.scheduling.simulate) both
keep their residency here, so the rules the simulator replays are the store's own:

- Tiers, fastest first, each a byte capacity with its own eviction policy. They are exclusive: an
  expert is resident in at most one. A placed expert goes to the fastest tier it fits in; one
  evicted from a faster tier moves down to the next, one evicted from the last is dropped. An
  expert larger than every tier is served without being cached ("streamed").
- Protection: placing an expert never evicts one the running layer needs (begin_layer pins them),
  nor an unused preload of its own layer (a layer's preloads do not push each other out).
- Admission: of predicted experts, those worth a preload by the last tier's policy (Tier.admit).
- The guard (edgemoe.scheduling.guard): with one, the scheme is measured against a ghost
  on-demand LRU cache of the same capacity at every layer, and preloads are refused while it says so.
- Counters: hits per tier, misses, streamed, preloads used (asked for before eviction) and wasted.

Items are any objects with `key` ((layer, expert)) and `nbytes`. `enter(item, tier_name)` adapts an
item to the tier it enters (the store copies it to the device for a VRAM tier and back to the host
when it is demoted); the default keeps it as it is. `leave(item)` is told of every item that leaves
the cache or is served without entering it (the store recycles its read buffer). Callers hold their
own lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .guard import GuardedPolicy

Key = tuple[int, int]


@dataclass
class TierStats:
    hits: int = 0
    evictions: int = 0
    bytes: int = 0          # resident now
    peak_bytes: int = 0


@dataclass
class CacheStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)
    misses: int = 0               # requests not served from a tier
    streamed: int = 0             # served without caching (larger than every tier's room)
    preloads_used: int = 0        # preloaded, then asked for before eviction
    preloads_wasted: int = 0      # preloaded, evicted without use

    @property
    def hits(self) -> int:
        return sum(t.hits for t in self.tiers.values())

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


class Tier:
    """A byte-budgeted map key -> item with an eviction policy."""

    def __init__(self, name: str, capacity: int, policy, stats: TierStats):
        self.name, self.capacity, self.policy, self.stats = name, capacity, policy, stats
        self.items: OrderedDict[Key, object] = OrderedDict()
        policy.set_capacity(capacity)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def put(self, item, protect: set[Key] = frozenset()) -> tuple[bool, list]:
        """Insert, evicting by policy (never a protected key) until it fits. Returns whether it was
        inserted (not if only protected experts could make room) and the evicted items."""
        evicted = self.evict_to(self.capacity - item.nbytes, protect)
        if self.stats.bytes + item.nbytes > self.capacity:
            return False, evicted
        self.items[item.key] = item
        self.policy.insert(item.key)
        self.stats.bytes += item.nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes)
        return True, evicted

    def evict_to(self, nbytes: int, protect: set[Key] = frozenset()) -> list:
        """Evict by policy (never a protected key) until at most `nbytes` are resident, or only
        protected items are left; returns the evicted items."""
        evicted = []
        while self.stats.bytes > nbytes:
            key = self.policy.resident_victim(protect)   # the policy's victim among the unprotected items
            if key is None:
                break
            evicted.append(self.pop(key))
            self.stats.evictions += 1
        return evicted

    def admit(self, preloads, protect: set[Key] = frozenset()) -> list[Key]:
        """Which of `preloads` ((key, nbytes, probability of use), most wanted first) are worth a
        read: each must fit in free room or in the room of victims the policy would pick (as put
        does, never a protected key nor another admitted preload's victim), and the policy must
        admit it (policy.admits, per victim; victim None in free room)."""
        free = self.capacity - self.stats.bytes
        spoken_for = set(protect)
        admitted = []
        for key, nbytes, probability in preloads:
            victims, room, excluded = [], free, set(spoken_for)
            while room < nbytes:
                victim = self.policy.resident_victim(excluded)
                if victim is None:
                    break
                victims.append(victim)
                excluded.add(victim)
                room += self.items[victim].nbytes
            if room >= nbytes and all(self.policy.admits(probability, v) for v in victims or [None]):
                admitted.append(key)
                spoken_for.update(victims)
                free = room - nbytes
        return admitted

    def pop(self, key: Key):
        item = self.items.pop(key)
        self.policy.remove(key)
        self.stats.bytes -= item.nbytes
        return item


class ExpertCache:
    """Tiers (name, capacity) fastest first, each with a policy from `make_policy()`."""

    def __init__(self, tiers: Iterable[tuple[str, int]], make_policy: Callable[[], object], guard=None,
                 enter: Callable[[object, str], object] | None = None, stats: CacheStats | None = None,
                 leave: Callable[[object], None] | None = None):
        self.stats = stats or CacheStats()
        self.guard = guard
        self.tiers = []
        for name, capacity in tiers:
            tier_stats = self.stats.tiers.setdefault(name, TierStats())
            self.tiers.append(Tier(name, capacity, make_policy(), tier_stats))
        if guard is not None:   # the guard judges the tier experts leave the cache from
            guard.measure_against(self.tiers[-1].policy)
            self.tiers[-1].policy = GuardedPolicy(self.tiers[-1].policy, guard)
        self._enter = enter or (lambda item, tier: item)
        self._leave = leave or (lambda item: None)
        self.pinned: set[Key] = set()        # needed by the running layer (begin_layer)
        self.preloaded: set[Key] = set()     # placed on a prediction, not yet asked for
        self.urgent: set[Key] = set()        # placed for the running layer before it asked: a miss

    # ---- queries ----------------------------------------------------------------------------------
    def find(self, key: Key):
        """The resident item of `key`, or None; not counted as a request."""
        for tier in self.tiers:
            if key in tier.items:
                return tier.items[key]
        return None

    def count(self) -> int:
        """How many experts are resident, in all tiers."""
        return sum(len(tier.items) for tier in self.tiers)

    def resident(self) -> dict[Key, str]:
        """Every resident key and the name of its tier."""
        return {key: tier.name for tier in reversed(self.tiers) for key in tier.items}

    # ---- events -----------------------------------------------------------------------------------
    def resize_last_tier(self, capacity: int) -> None:
        """The last tier (the one experts leave the cache from) holds up to `capacity` bytes from now
        on (--ram auto's second look, edgemoe.ram_growth). Made smaller, it evicts by its policy,
        never a pinned expert, until it fits. Its policy is told (adaptive eviction's ghosts keep
        what they hold and take their share), and so is the guard's ghost of the same capacity."""
        tier = self.tiers[-1]
        tier.capacity = capacity
        tier.policy.set_capacity(capacity)
        for victim in tier.evict_to(capacity, self.pinned):
            self._forget(victim.key)
            self._leave(victim)
        if self.guard is not None:
            self.guard.ghost.budget = capacity

    def clear(self) -> None:
        """Forget every resident expert (a closed store's), so that their memory is freed now."""
        for tier in self.tiers:
            for key in list(tier.items):
                tier.pop(key)
        self.pinned.clear()
        self.preloaded.clear()
        self.urgent.clear()

    def request(self, key: Key):
        """A request for `key`: its item, counted as a hit (or as a miss when it was placed for this
        very request, kind "urgent"), or None when it is not resident (the caller reads and places it)."""
        for tier in self.tiers:
            if key in tier.items:
                tier.policy.touch(key)
                if key in self.urgent:
                    self.urgent.discard(key)
                    self.stats.misses += 1
                else:
                    tier.stats.hits += 1
                    if key in self.preloaded:
                        self.preloaded.discard(key)
                        self.stats.preloads_used += 1
                return tier.items[key]
        return None

    def count_hits(self, first_layer: int, chosen: list[list[int]]) -> None:
        """Requests for the experts chosen[0] of first_layer, chosen[1] of the next layer, ..., every
        one resident, counted as request() counts them, while every expert is resident and none is
        ever read again (TieredStore.served_resident). The policies are not told: they only choose
        victims, and there will be none (a touch per key, through every candidate of the adaptive
        policy, cost a fine-grained model's decode step 2-7%: docs/benchmarks.md, "thirteenth
        part"). Keys placed by a preload or for an urgent request are counted one by one, as
        request() does."""
        holding = [tier for tier in self.tiers if tier.items]
        if len(holding) == 1 and not (self.preloaded or self.urgent):   # each key resident, so in this tier
            holding[0].stats.hits += sum(map(len, chosen))
            return
        keys = [(layer, e) for layer, experts in enumerate(chosen, first_layer) for e in experts]
        if self.preloaded or self.urgent:
            for key in keys:
                self.request(key)
            return
        for tier in holding:
            tier.stats.hits += sum(map(tier.items.__contains__, keys))

    def place(self, item, kind: str):
        """Cache a freshly read item in the fastest tier it fits; returns what the caller should use
        (the item as it entered its tier). kind: "demand" (asked for now: a miss and a use),
        "preload" (predicted), "urgent" (the running layer will ask for it) or "placement" (initial)."""
        if kind == "demand":
            self.stats.misses += 1
        protect = self._protected(item.key)
        placed = None
        for i, tier in enumerate(self.tiers):
            if tier.fits(item.nbytes):
                placed = self._put(i, self._enter(item, tier.name), protect)
                if placed is not None:
                    break
        if placed is None:
            self.stats.streamed += 1
            self._leave(item)
            return item
        if kind == "preload":
            self.preloaded.add(item.key)
        elif kind == "urgent":
            self.urgent.add(item.key)
        elif kind == "demand":
            self._tier_of(item.key).policy.touch(item.key)
        return placed

    def discard(self, key: Key) -> None:
        """Drop `key`'s item (the store replaces a fallback copy by the expert itself): neither an
        eviction nor a wasted preload."""
        self._leave(self._tier_of(key).pop(key))
        self.preloaded.discard(key)
        self.urgent.discard(key)

    def begin_layer(self, layer: int, needed: dict[Key, int], read_bytes: int = 0) -> None:
        """The model is about to run `layer`, which needs the experts `needed` (key -> bytes): they
        are pinned until the next begin_layer and the policies are told; the guard compares
        `read_bytes`, the bytes read from disk so far (demand and preloads), with its ghost's. The
        policies are told the layer and `needed` with its sizes (the adaptive policy's ghosts request them)."""
        self.pinned = set(needed)
        if self.guard is not None:
            self.guard.observe_layer(((k, needed[k]) for k in sorted(needed)), read_bytes)
        for tier in self.tiers:
            tier.policy.set_layer(layer, needed)

    def admit(self, wanted) -> list[Key]:
        """Of `wanted` ((key, nbytes, probability of use), most wanted first, none resident), those
        worth a preload: admitted by the policy of the tier experts leave the cache from, beside the
        running layer's experts and the unused preloads of the keys' layers. None while the guard
        has preloading off."""
        if self.guard is not None and not self.guard.allow_preload:
            return []
        wanted = list(wanted)
        layers = {key[0] for key, _, _ in wanted}
        protect = self.pinned | {k for k in self.preloaded if k[0] in layers}
        last = next((t for t in reversed(self.tiers) if t.capacity), self.tiers[-1])
        return last.admit(wanted, protect)

    # ---- internals --------------------------------------------------------------------------------
    def _protected(self, key: Key) -> set[Key]:
        return (self.pinned | {k for k in self.preloaded if k[0] == key[0]}) - {key}

    def _put(self, i: int, item, protect: set[Key]):
        """Put item in tier i, moving what it evicts down a tier; the placed item, or None."""
        placed, evicted = self.tiers[i].put(item, protect)
        for victim in evicted:
            self._demote(i + 1, victim, protect)
        if not placed:
            if i + 1 == len(self.tiers):
                self._forget(item.key)
            return None
        return item

    def _demote(self, i: int, item, protect: set[Key]) -> None:
        if i < len(self.tiers) and self.tiers[i].fits(item.nbytes):
            if self._put(i, self._enter(item, self.tiers[i].name), protect) is not None:
                return
        self._forget(item.key)
        self._leave(item)

    def _forget(self, key: Key) -> None:
        """key left the cache."""
        self.urgent.discard(key)
        if key in self.preloaded:
            self.preloaded.discard(key)
            self.stats.preloads_wasted += 1

    def _tier_of(self, key: Key) -> Tier:
        return next(t for t in self.tiers if key in t.items)
