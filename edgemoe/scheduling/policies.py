"""Eviction policies for a tier: which resident expert to drop when room is needed.

A policy sees every access (`touch`), insertion and removal, and the layer the model is about to run
with the experts it needs (`set_layer`); `victim` picks among the candidates; `admits(p, victim)`
says whether a preload used with probability p is worth its read and evicting `victim` (None: it
fits in free room); every policy but "expected-use" admits every preload. Keys are (layer, expert).

- "lru": least recently used (the baseline; Mixtral-offloading's scheme).
- "lfu": least frequently used: fewest accesses, ties by LRU. Counts survive eviction (as EdgeMoE's do),
  so an expert that comes back keeps its history; the popularity prior is not used.
- "frequency-distance": EdgeMoE's rule: keep experts that are used often and whose layer runs soon. score =
  (1 + accesses + prior) * (L - d) / L, where d in 0..L-1 is how many layers after the running one
  the expert's layer comes (0: the layer running now, L-1: the one that just ran); the lowest score
  goes, ties by LRU. `prior` is the profile's popularity when one is given; the 1 keeps a fresh
  (preloaded, not yet used) expert from being the first victim for being new.
- "expected-use": EdgeMoE's idea (keep what is used often and soon) with its frequency replaced by
  a probability. Each resident expert's estimate p = P(used the next time its layer runs), from the
  routing profile: for the layer that runs next in this step, P(e | this step's experts at the
  layers before) (RoutingProfile.predict, when its key was seen min_count times); otherwise "stay"
  P(used by the next token | used by this one) if the expert was used the last time its layer ran,
  else "arrive" P(used | not used) (RoutingProfile.reuse; popularity for a profile without temporal
  counts). The victim has the fewest expected uses per layer of residence, p / d, d = layers until
  its layer runs (1 = the next, L = the running one): a slot held d layers for a use with
  probability p; ties go to the furthest layer (Belady's rule), then LRU. Plain lowest-p eviction
  measured worse than LRU (docs/scheduling.md): holding an expert for the far future costs more.
  A preload with probability p costs a read, and when unused (1 - p) a wasted read plus, with
  probability q (the victim's estimate), a read of the victim it displaced; it converts p demand
  misses into background reads. It is admitted if p > (1 - p)(1 + q): more misses converted than
  reads added (in free room q = 0: p > 0.5). Without a routing profile every estimate is the
  popularity prior (0 without one).
- "adaptive": set dueling (as CPU caches and ARC choose between policies). Which fixed policy reads
  least depends on the routing and on the cache size (docs/scheduling.md), so a ghost cache per
  candidate (lru, lfu, frequency-distance, and expected-use where there is a routing profile: keys
  and sizes only, the tier's capacity, on-demand: GhostCache) is fed every layer's requests, and
  the tier evicts as the candidate whose ghost read the fewest bytes over the last
  ADAPTIVE_WINDOW_TOKENS tokens' layers would. It starts as LRU and changes candidate only when
  another one read at least ADAPTIVE_MARGIN less over the window (hysteresis: near-ties do not
  flip it back and forth). Its `read_bytes` (what on-demand caching that follows the leader reads)
  is the reference its guard holds the scheme to (edgemoe.scheduling.guard). Each candidate's own policy object follows the tier's real events, so a switch loses no
  history. Preload admission is expected-use's rule where there is a profile (the only one that
  weighs a preload against its victim), else every preload is admitted. Bookkeeping: per layer,
  one pass of its requests through each ghost (at most the tier's capacity in keys each) and a
  window of per-layer read counts; the CPU time this costs is measured in docs/scheduling.md. With
  two tiers (VRAM and RAM) each tier's ghosts see every request: for the faster tier, an
  approximation of what reaches it.

Every policy is told its tier's byte capacity once (set_capacity: only "adaptive" uses it, for its
ghosts) and, at each layer, the experts it needs with their sizes (set_layer's `needed`: key -> bytes,
or any iterable of keys for the policies that ignore sizes).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Iterable, Mapping

from edgemoe.options import one_of

Key = tuple[int, int]


class LRUPolicy:
    name = "lru"

    def __init__(self, num_layers: int = 1, popularity: dict[Key, float] | None = None, profile=None):
        self._clock = itertools.count()
        self.last_use: dict[Key, int] = {}

    def touch(self, key: Key) -> None:
        self.last_use[key] = next(self._clock)

    def insert(self, key: Key) -> None:
        self.touch(key)

    def remove(self, key: Key) -> None:
        self.last_use.pop(key, None)

    def set_capacity(self, capacity: int) -> None:
        pass

    def set_layer(self, layer: int, needed: Iterable[Key] = ()) -> None:
        pass

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=lambda k: self.last_use.get(k, -1))

    def admits(self, probability: float, victim: Key | None) -> bool:
        return True


class LFUPolicy(LRUPolicy):
    name = "lfu"

    def __init__(self, num_layers: int = 1, popularity: dict[Key, float] | None = None, profile=None):
        super().__init__(num_layers)
        self.accesses: dict[Key, int] = {}   # kept across evictions: frequency is the expert's, not the copy's

    def touch(self, key: Key) -> None:
        super().touch(key)
        self.accesses[key] = self.accesses.get(key, 0) + 1

    def insert(self, key: Key) -> None:
        LRUPolicy.touch(self, key)  # residency is not an access: only the model's use counts

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=lambda k: (self.accesses.get(k, 0), self.last_use.get(k, -1)))


class FrequencyDistancePolicy(LFUPolicy):
    name = "frequency-distance"

    def __init__(self, num_layers: int, popularity: dict[Key, float] | None = None, profile=None):
        super().__init__(num_layers)
        self.num_layers = num_layers
        self.current_layer = 0
        self.prior = popularity or {}

    def set_layer(self, layer: int, needed: Iterable[Key] = ()) -> None:
        self.current_layer = layer

    def score(self, key: Key) -> float:
        distance = (key[0] - self.current_layer) % self.num_layers   # 0 = running now
        frequency = 1 + self.accesses.get(key, 0) + self.prior.get(key, 0.0)
        return frequency * (self.num_layers - distance) / self.num_layers

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=lambda k: (self.score(k), self.last_use.get(k, -1)))


class ExpectedUsePolicy(LRUPolicy):
    name = "expected-use"

    def __init__(self, num_layers: int, popularity: dict[Key, float] | None = None, profile=None):
        super().__init__(num_layers)
        self.profile = profile
        self.prior = popularity or {}
        self.order = list(profile.moe_layers) if profile else list(range(num_layers))
        self.position = {l: i for i, l in enumerate(self.order)}
        self.current: int | None = None
        self.step = 0                            # advances when a layer runs again: a new step (token)
        self.history: dict[int, tuple[int, ...]] = {}   # this step's experts per layer, for predict
        self.last_run: dict[int, int] = {}       # layer -> the step it last ran in
        self.used_in: dict[Key, int] = {}        # expert -> the last step that used it (kept on eviction)
        self.next_probability: dict[Key, float] = {}
        self._reuse: dict[tuple[int, int, bool], float] = {}

    def set_layer(self, layer: int, needed: Iterable[Key] = ()) -> None:
        if self.current is not None and self.position.get(layer, 0) <= self.position.get(self.current, 0):
            self.step += 1
            self.history = {}
        self.current = layer
        self.last_run[layer] = self.step
        experts = sorted(e for l, e in needed if l == layer)
        for e in experts:
            self.used_in[(layer, e)] = self.step
        self.history[layer] = tuple(experts)
        self.next_probability = self._predict_next()

    def touch(self, key: Key) -> None:
        super().touch(key)
        self.used_in[key] = self.step

    def _predict_next(self) -> dict[Key, float]:
        """P(e) for the layer after the running one in this step, from the correlation table; empty
        when there is none or the profile only knows popularity for this history (then temporal
        statistics, which know this expert's own recent use, are the better guess)."""
        i = self.position.get(self.current)
        if self.profile is None or i is None or i + 1 >= len(self.order):
            return {}
        nxt = self.order[i + 1]
        if self.profile.source(nxt, self.history) == "popularity":
            return {}
        return {(nxt, e): p for e, p in self.profile.predict(nxt, self.history)}

    def estimate(self, key: Key) -> float:
        """P(key is used the next time its layer runs)."""
        p = self.next_probability.get(key)
        if p is not None:
            return p
        layer, expert = key
        used = layer in self.last_run and self.used_in.get(key) == self.last_run[layer]
        if self.profile is None:
            return self.prior.get(key, 0.0)
        cached = self._reuse.get((layer, expert, used))
        if cached is None:
            cached = self._reuse[(layer, expert, used)] = self.profile.reuse(layer, expert, used)
        return cached

    def distance(self, key: Key) -> int:
        """Layers until key's layer runs next: 1 (the next one) .. n (the running one, next step)."""
        n = len(self.order)
        d = (self.position.get(key[0], 0) - self.position.get(self.current, 0)) % n
        return d or n

    def victim(self, candidates: Iterable[Key]) -> Key:
        def density(k: Key) -> tuple:
            d = self.distance(k)
            return self.estimate(k) / d, -d, self.last_use.get(k, -1)
        return min(candidates, key=density)

    def admits(self, probability: float, victim: Key | None) -> bool:
        displaced = self.estimate(victim) if victim is not None else 0.0
        return probability > (1 - probability) * (1 + displaced)


class GhostCache:
    """What one policy alone would miss, caching on demand in `capacity` bytes: keys and sizes only.
    The real cache's rules (edgemoe.scheduling.cache): placing an expert never evicts one the running
    layer needs, an expert larger than the capacity is served uncached, and a miss that only needed
    experts could make room for is served uncached after the evictions made."""

    def __init__(self, policy, capacity: int):
        self.policy, self.capacity = policy, capacity
        self.items: dict[Key, int] = {}
        self.bytes = 0
        self.misses = 0
        self.read_bytes = 0

    def run_layer(self, layer: int, needed: Mapping[Key, int]) -> int:
        """The layer begins and asks for its experts in ascending order, as the runtime runs them;
        returns the bytes it read (its misses')."""
        self.policy.set_layer(layer, needed)
        before = self.read_bytes
        for key in sorted(needed):
            self.request(key, needed[key], needed)
        return self.read_bytes - before

    def request(self, key: Key, nbytes: int, pinned: Iterable[Key] = ()) -> None:
        if key in self.items:
            self.policy.touch(key)
            return
        self.misses += 1
        self.read_bytes += nbytes
        if nbytes > self.capacity:
            return
        while self.bytes + nbytes > self.capacity:
            candidates = [k for k in self.items if k not in pinned]
            if not candidates:
                return
            victim = self.policy.victim(candidates)
            self.bytes -= self.items.pop(victim)
            self.policy.remove(victim)
        self.items[key] = nbytes
        self.bytes += nbytes
        self.policy.insert(key)
        self.policy.touch(key)


ADAPTIVE_CANDIDATES = ("lru", "lfu", "frequency-distance", "expected-use")
ADAPTIVE_WINDOW_TOKENS = 16   # misses are compared over this many tokens' layer calls
ADAPTIVE_MARGIN = 0.02        # another candidate leads once it missed this much less over the window


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, num_layers: int, popularity: dict[Key, float] | None = None, profile=None,
                 window_tokens: int = ADAPTIVE_WINDOW_TOKENS, margin: float = ADAPTIVE_MARGIN):
        self.candidates = [n for n in ADAPTIVE_CANDIDATES if n != "expected-use" or profile is not None]
        self._make = lambda name: POLICIES[name](num_layers, popularity, profile)
        self.followers = {name: self._make(name) for name in self.candidates}   # fed the tier's own events
        self.ghosts: dict[str, GhostCache] = {}
        self.leader = self.candidates[0]
        self.margin = margin
        self.window: deque[tuple[int, ...]] = deque(maxlen=window_tokens * max(1, num_layers))
        self.window_reads = [0] * len(self.candidates)   # each ghost's bytes read over the window
        self.read_bytes = 0   # what on-demand caching that follows the leader reads: the leader's ghost's reads
        self.changes: list[tuple[int, str]] = []   # (layer calls so far, candidate followed from then)
        self._layer_calls = 0

    def set_capacity(self, capacity: int) -> None:
        self.ghosts = {name: GhostCache(self._make(name), capacity) for name in self.candidates}

    def set_layer(self, layer: int, needed: Mapping[Key, int]) -> None:
        for follower in self.followers.values():
            follower.set_layer(layer, needed)
        self._layer_calls += 1
        if not self.ghosts:
            return
        reads = tuple(ghost.run_layer(layer, needed) for ghost in self.ghosts.values())
        self.read_bytes += reads[self.candidates.index(self.leader)]
        if len(self.window) == self.window.maxlen:
            self.window_reads = [total - old for total, old in zip(self.window_reads, self.window[0])]
        self.window.append(reads)
        self.window_reads = [total + new for total, new in zip(self.window_reads, reads)]
        self._follow_the_best()

    def _follow_the_best(self) -> None:
        read = dict(zip(self.candidates, self.window_reads))
        best = min(self.candidates, key=read.get)   # ties: the earlier candidate
        if read[best] < read[self.leader] * (1 - self.margin):
            self.leader = best
            self.changes.append((self._layer_calls, best))

    def touch(self, key: Key) -> None:
        for follower in self.followers.values():
            follower.touch(key)

    def insert(self, key: Key) -> None:
        for follower in self.followers.values():
            follower.insert(key)

    def remove(self, key: Key) -> None:
        for follower in self.followers.values():
            follower.remove(key)

    def victim(self, candidates: Iterable[Key]) -> Key:
        return self.followers[self.leader].victim(candidates)

    def admits(self, probability: float, victim: Key | None) -> bool:
        judge = self.followers.get("expected-use")
        return judge.admits(probability, victim) if judge is not None else True


POLICIES = {p.name: p for p in (LRUPolicy, LFUPolicy, FrequencyDistancePolicy, ExpectedUsePolicy, AdaptivePolicy)}
DEFAULT_POLICY = "adaptive"   # a store's eviction unless told otherwise (edgemoe.loader.StoreOptions)


def make_policy(name: str, num_layers: int, popularity: dict[Key, float] | None = None, profile=None):
    """profile: the store's RoutingProfile (or None), for policies that predict."""
    one_of(name, "policy=", sorted(POLICIES))
    return POLICIES[name](num_layers, popularity, profile)
