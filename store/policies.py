"""Eviction policies for a tier: which resident expert to drop when room is needed.

A policy sees every access (`touch`), insertion and removal, and the layer the model is about to run
(`set_layer`); `victim` picks among the candidates. Keys are (layer, expert).

- "lru": least recently used (the baseline; Mixtral-offloading's scheme).
- "lfu": least frequently used: fewest accesses, ties by LRU. Counts survive eviction (as EdgeMoE's do),
  so an expert that comes back keeps its history; the popularity prior is not used.
- "edgemoe": EdgeMoE's rule: keep experts that are used often and whose layer runs soon. score =
  (1 + accesses + prior) * (L - d) / L, where d in 0..L-1 is how many layers after the running one
  the expert's layer comes (0: the layer running now, L-1: the one that just ran); the lowest score
  goes, ties by LRU. `prior` is the profile's popularity when one is given; the 1 keeps a fresh
  (preloaded, not yet used) expert from being the first victim for being new.
"""

from __future__ import annotations

import itertools
from typing import Iterable

Key = tuple[int, int]


class LRUPolicy:
    name = "lru"

    def __init__(self, num_layers: int = 1, popularity: dict[Key, float] | None = None):
        self._clock = itertools.count()
        self.last_use: dict[Key, int] = {}

    def touch(self, key: Key) -> None:
        self.last_use[key] = next(self._clock)

    def insert(self, key: Key) -> None:
        self.touch(key)

    def remove(self, key: Key) -> None:
        self.last_use.pop(key, None)

    def set_layer(self, layer: int) -> None:
        pass

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=lambda k: self.last_use.get(k, -1))


class LFUPolicy(LRUPolicy):
    name = "lfu"

    def __init__(self, num_layers: int = 1, popularity: dict[Key, float] | None = None):
        super().__init__(num_layers)
        self.accesses: dict[Key, int] = {}   # kept across evictions: frequency is the expert's, not the copy's

    def touch(self, key: Key) -> None:
        super().touch(key)
        self.accesses[key] = self.accesses.get(key, 0) + 1

    def insert(self, key: Key) -> None:
        LRUPolicy.touch(self, key)  # residency is not an access: only the model's use counts

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=lambda k: (self.accesses.get(k, 0), self.last_use.get(k, -1)))


class EdgeMoEPolicy(LFUPolicy):
    name = "edgemoe"

    def __init__(self, num_layers: int, popularity: dict[Key, float] | None = None):
        super().__init__(num_layers)
        self.num_layers = num_layers
        self.current_layer = 0
        self.prior = popularity or {}

    def set_layer(self, layer: int) -> None:
        self.current_layer = layer

    def score(self, key: Key) -> float:
        distance = (key[0] - self.current_layer) % self.num_layers   # 0 = running now
        frequency = 1 + self.accesses.get(key, 0) + self.prior.get(key, 0.0)
        return frequency * (self.num_layers - distance) / self.num_layers

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=lambda k: (self.score(k), self.last_use.get(k, -1)))


POLICIES = {p.name: p for p in (LRUPolicy, LFUPolicy, EdgeMoEPolicy)}


def make_policy(name: str, num_layers: int, popularity: dict[Key, float] | None = None):
    if name not in POLICIES:
        from .format import StoreError
        raise StoreError(f"policy={name!r}: expected one of {sorted(POLICIES)}")
    return POLICIES[name](num_layers, popularity)
