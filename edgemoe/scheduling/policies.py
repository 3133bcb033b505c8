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
  (preloaded, not yet used) expert from being the first victim for being new. Scores are kept as
  exact integers (frequencies in units of 2**-PRIOR_BITS, times L - d), so that no two round equal.
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
  the tier evicts as the candidate whose ghost read the fewest bytes over the last layer calls
  holding ADAPTIVE_WINDOW_REQUESTS of their requests would. It starts as LRU and changes candidate only when
  another one read at least ADAPTIVE_MARGIN less over the window (hysteresis: near-ties do not
  flip it back and forth). Its `read_bytes` (what on-demand caching that follows the leader reads)
  is the reference its guard holds the scheme to (edgemoe.scheduling.guard). Each candidate's own policy object follows the tier's real events, so a switch loses no
  history. Preload admission is expected-use's rule where there is a profile (the only one that
  weighs a preload against its victim), else every preload is admitted. Where a token makes many
  requests (MoE layers x top-k over ADAPTIVE_GHOST_REQUESTS: fine-grained models; counted from the
  routing profile, else from the model's shape given as `routing`), the ghosts see a sample of the
  layers, as set dueling samples a cache's sets: every k-th MoE layer, each ghost with that share of
  the capacity (its reads scaled back to the whole model for read_bytes); elsewhere (and with
  nothing to count by) every layer, and each ghost then misses exactly what its policy alone would.
  Bookkeeping: per sampled layer, one pass of its requests through each ghost (at most its capacity
  in keys each) and a window of per-layer read counts; the CPU time this costs is measured in
  docs/scheduling.md. With two tiers (VRAM and RAM) each tier's ghosts see every request: for the
  faster tier, an approximation of what reaches it.

Finding a victim. `victim(candidates)` defines each policy's choice over a list of keys;
`resident_victim(pinned)`, what the tiers and ghosts call, makes the same choice among the keys the
policy was given by insert and not yet by remove, but pinned, without going through all of them:
every policy's victim value is a distance-free order within a layer (layer_order_key) weighed by the
layer's distance to the running layer (layer_values), and a larger order never has a smaller value
(exact scores, and the order itself as the tie-break), so the victim is the least of each layer's
least key (LayerOrder): an eviction compares one value per layer, each kept until its layer changes
or, for the policies that weigh distance, the running layer moves (tests/test_victim_order.py checks
the two at every eviction of random streams).

Every policy is told its tier's byte capacity (set_capacity, again when a tier grows: only "adaptive"
uses it, for its ghosts) and, at each layer, the experts it needs with their sizes (set_layer's
`needed`: key -> bytes, or any iterable of keys for the policies that ignore sizes).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Container, Iterable, Mapping, NamedTuple

from edgemoe.options import one_of

Key = tuple[int, int]


class RoutingShape(NamedTuple):
    """What a token asks of the experts: its MoE layers in the order they run and top-k requests at each
    (a RoutingProfile has both attributes too)."""

    moe_layers: list[int]
    top_k: int


class LayerOrder:
    """A policy's resident keys by layer, with each layer's first key in the policy's order within a
    layer (`order_key`: distance-free, so kept until something in that layer changes) and that key's
    victim value (`values`: the policy's layer_values, which weigh the layer's distance to the running
    layer, so dropped whenever the running layer moves). A policy's victim is the least of the layers'
    values, not of every resident key: within a layer the victim order is the order within the layer."""

    def __init__(self, order_key):
        self.order_key = order_key
        self.keys: dict[int, set[Key]] = {}
        self.first: dict[int, tuple[tuple, Key]] = {}    # layer -> (order, key): its least key, none pinned
        self.values: dict[int, tuple[tuple, Key]] = {}   # layer -> (victim value, key) of that key
        self.stale: set[int] = set()                     # layers whose values are not made (or hold no key)

    def add(self, key: Key) -> None:
        self.keys.setdefault(key[0], set()).add(key)
        self.changed(key[0])

    def discard(self, key: Key) -> None:
        layer = self.keys.get(key[0])
        if layer is not None:
            layer.discard(key)
            if not layer:
                del self.keys[key[0]]
        self.changed(key[0])

    def changed(self, layer: int) -> None:
        self.first.pop(layer, None)
        self.values.pop(layer, None)
        self.stale.add(layer)

    def moved(self) -> None:
        """The running layer moved: every layer's distance changed (not the order within a layer)."""
        self.values.clear()
        self.stale = set(self.keys)

    def least(self, layer: int, pinned: Container[Key] = ()) -> tuple[tuple, Key] | None:
        """(order, key) of the layer's least key that is not pinned, None if every one is."""
        if not pinned:
            entry = self.first.get(layer)
            if entry is None:
                entry = self.first[layer] = min((self.order_key(k), k) for k in self.keys[layer])
            return entry
        return min(((self.order_key(k), k) for k in self.keys[layer] if k not in pinned), default=None)


class LRUPolicy:
    name = "lru"

    def __init__(self, num_layers: int = 1, popularity: dict[Key, float] | None = None, profile=None):
        self._clock = itertools.count()
        self.last_use: dict[Key, int] = {}
        self.resident = LayerOrder(self.layer_order_key)   # what insert and remove left: a ghost's keys

    def touch(self, key: Key) -> None:
        self.last_use[key] = next(self._clock)
        self.resident.changed(key[0])

    def insert(self, key: Key) -> None:
        self.resident.add(key)
        self.touch(key)

    def remove(self, key: Key) -> None:
        self.last_use.pop(key, None)
        self.resident.discard(key)

    def set_capacity(self, capacity: int) -> None:
        pass

    def set_layer(self, layer: int, needed: Iterable[Key] = ()) -> None:
        pass

    def layer_order_key(self, key: Key) -> tuple:
        """The victim order among one layer's keys (no distance in it), the last use last: unique
        among inserted keys."""
        return (self.last_use.get(key, -1),)

    def layer_values(self, firsts: Mapping[int, tuple[tuple, Key]]) -> dict[int, tuple[tuple, Key]]:
        """layer -> (victim value, key) for layer -> (order, key): what victim minimises across layers,
        the order weighed by the layer's distance. Within a layer a larger order never has a smaller
        value: the order within a layer is the victim order."""
        return dict(firsts)

    def victim_key(self, key: Key) -> tuple:
        """What victim minimises: layer_values for the key alone."""
        return self.layer_values({key[0]: (self.layer_order_key(key), key)})[key[0]][0]

    def victim(self, candidates: Iterable[Key]) -> Key:
        return min(candidates, key=self.victim_key)

    def resident_victim(self, pinned: Container[Key]) -> Key | None:
        """victim() among the resident keys (inserted, not removed) that are not pinned, None if there
        are none; the same key, found among each layer's least key (LayerOrder)."""
        order = self.resident
        if order.stale:
            first, keys = order.first, order.keys
            order.values.update(self.layer_values({l: first[l] if l in first else order.least(l)
                                                   for l in order.stale if l in keys}))
            order.stale.clear()
        if not order.values:
            return None
        best = min(order.values.values())
        if best[1] not in pinned:
            return best[1]
        choices = [entry for entry in order.values.values() if entry[1] not in pinned]
        for layer, (_, key) in order.values.items():
            if key in pinned and (least := order.least(layer, pinned)) is not None:
                choices.extend(self.layer_values({layer: least}).values())
        return min(choices)[1] if choices else None

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
        self.resident.add(key)
        LRUPolicy.touch(self, key)  # residency is not an access: only the model's use counts

    def layer_order_key(self, key: Key) -> tuple:
        return self.accesses.get(key, 0), self.last_use.get(key, -1)


# frequency-distance's frequencies in units of 2**-PRIOR_BITS (an integer): its scores, frequency x
# (layers - distance), are then exact, so that within a layer a larger frequency never scores equal
# (a rounding tie would break by last use against the order within the layer).
PRIOR_BITS = 20


class FrequencyDistancePolicy(LFUPolicy):
    name = "frequency-distance"

    def __init__(self, num_layers: int, popularity: dict[Key, float] | None = None, profile=None):
        super().__init__(num_layers)
        self.num_layers = num_layers
        self.current_layer = 0
        self.prior = {key: round(p * (1 << PRIOR_BITS)) for key, p in (popularity or {}).items()}

    def set_layer(self, layer: int, needed: Iterable[Key] = ()) -> None:
        self.current_layer = layer
        self.resident.moved()

    def frequency(self, key: Key) -> int:
        """1 + accesses + prior, in units of 2**-PRIOR_BITS."""
        return ((1 + self.accesses.get(key, 0)) << PRIOR_BITS) + self.prior.get(key, 0)

    def score(self, key: Key) -> int:
        """The frequency times (L - d), d = (key's layer - running layer) mod L: 0 = running now."""
        return self.frequency(key) * (self.num_layers - (key[0] - self.current_layer) % self.num_layers)

    def layer_order_key(self, key: Key) -> tuple:
        return self.frequency(key), self.last_use.get(key, -1)

    def layer_values(self, firsts):
        n, now = self.num_layers, self.current_layer
        return {l: ((order[0] * (n - (l - now) % n), order[1]), key) for l, (order, key) in firsts.items()}


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
        predicted_before = {l for l, _ in self.next_probability}
        self.next_probability = self._predict_next()
        # estimates moved in the running layer (its uses) and in the predicted layers, old and new
        for l in {layer} | predicted_before | {l for l, _ in self.next_probability}:
            self.resident.changed(l)
        self.resident.moved()

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

    def layer_order_key(self, key: Key) -> tuple:
        return self.estimate(key), self.last_use.get(key, -1)

    def layer_values(self, firsts):
        """(p / d, -d, p, last use): the expected uses per layer of residence; ties go to the furthest
        layer; the p repeats the order within a layer where p / d rounds equal."""
        values = {}
        for layer, (order, key) in firsts.items():
            d = self.distance(key)
            values[layer] = ((order[0] / d, -d) + order, key)
        return values

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
            victim = self.policy.resident_victim(pinned)
            if victim is None:
                return
            self.bytes -= self.items.pop(victim)
            self.policy.remove(victim)
        self.items[key] = nbytes
        self.bytes += nbytes
        self.policy.insert(key)
        self.policy.touch(key)


ADAPTIVE_CANDIDATES = ("lru", "lfu", "frequency-distance", "expected-use")
# Misses are compared over the layer calls of at least this many of the ghosts' requests (16 tokens of a
# Mixtral-shaped model, 32 layers x top-2, and of a sampled fine-grained one; more tokens where a token
# makes fewer requests, so that a shallow model's window is not a few noisy tokens: docs/scheduling.md).
ADAPTIVE_WINDOW_REQUESTS = 1024
ADAPTIVE_MARGIN = 0.02        # another candidate leads once it missed this much less over the window
# Where a token makes more requests than this (MoE layers x top-k, from the routing profile or the
# model), the ghosts see every k-th MoE layer, in the share of the capacity those layers' experts would
# get, so that they see about this many: set dueling's sampled sets. On fine-grained routing each layer's pass through the
# ghosts costs ~0.6-1 ms of Python (docs/scheduling.md), the decode step's order of magnitude; a
# Mixtral-shaped model (32 x 2) is below it, where sampling cost 2-5% more reads in the simulator.
ADAPTIVE_GHOST_REQUESTS = 64


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, num_layers: int, popularity: dict[Key, float] | None = None, profile=None,
                 window_requests: int = ADAPTIVE_WINDOW_REQUESTS, margin: float = ADAPTIVE_MARGIN,
                 ghost_requests: int | None = ADAPTIVE_GHOST_REQUESTS, routing: RoutingShape | None = None):
        """ghost_requests: about how many of a token's requests the ghosts see, by sampling layers
        (None, or neither a profile nor `routing` to count them by: every one; then each ghost misses
        exactly what its policy alone would). routing: the model's shape, where there is no profile."""
        self.candidates = [n for n in ADAPTIVE_CANDIDATES if n != "expected-use" or profile is not None]
        self._make = lambda name: POLICIES[name](num_layers, popularity, profile)
        self.followers = {name: self._make(name) for name in self.candidates}   # fed the tier's own events
        self.ghosts: dict[str, GhostCache] = {}
        self.leader = self.candidates[0]
        self.margin = margin
        shape = profile if profile is not None else routing
        layers = list(shape.moe_layers) if shape is not None else list(range(max(1, num_layers)))
        every = len(layers) * shape.top_k // ghost_requests if shape is not None and ghost_requests else 1
        self.ghost_layers = set(layers[::max(1, every)])
        self.ghost_share = len(self.ghost_layers) / len(layers)   # of the layers, so of the capacity
        self.window_requests = window_requests
        self.window: deque[tuple[tuple[int, ...], int]] = deque()   # per layer call: (each ghost's reads, requests)
        self.window_reads = [0] * len(self.candidates)   # each ghost's bytes read over the window
        self._requests_in_window = 0
        # what on-demand caching that follows the leader reads: the leader's ghost's reads, scaled to every layer
        self.read_bytes = 0
        self.changes: list[tuple[int, str]] = []   # (layer calls so far, candidate followed from then)
        self._layer_calls = 0

    def set_capacity(self, capacity: int) -> None:
        """The tier's capacity: the ghosts get their share of it; told again (a tier that grew), they
        keep what they hold and the window's counts."""
        share = int(capacity * self.ghost_share)
        if self.ghosts:
            for ghost in self.ghosts.values():
                ghost.capacity = share
            return
        self.ghosts = {name: GhostCache(self._make(name), share) for name in self.candidates}

    def set_layer(self, layer: int, needed: Mapping[Key, int]) -> None:
        for follower in self.followers.values():
            follower.set_layer(layer, needed)
        self._layer_calls += 1
        if not self.ghosts or layer not in self.ghost_layers:
            return
        reads = tuple(ghost.run_layer(layer, needed) for ghost in self.ghosts.values())
        self.read_bytes += round(reads[self.candidates.index(self.leader)] / self.ghost_share)
        self._add_to_window(reads, len(needed))
        self._follow_the_best()

    def _add_to_window(self, reads: tuple[int, ...], requests: int) -> None:
        """A layer call's reads into the window, which keeps the fewest latest calls holding at least
        window_requests requests."""
        self.window.append((reads, requests))
        self.window_reads = [total + new for total, new in zip(self.window_reads, reads)]
        self._requests_in_window += requests
        while self._requests_in_window - self.window[0][1] >= self.window_requests:
            old, count = self.window.popleft()
            self.window_reads = [total - gone for total, gone in zip(self.window_reads, old)]
            self._requests_in_window -= count

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

    def resident_victim(self, pinned: Container[Key]) -> Key | None:
        return self.followers[self.leader].resident_victim(pinned)

    def admits(self, probability: float, victim: Key | None) -> bool:
        judge = self.followers.get("expected-use")
        return judge.admits(probability, victim) if judge is not None else True


POLICIES = {p.name: p for p in (LRUPolicy, LFUPolicy, FrequencyDistancePolicy, ExpectedUsePolicy, AdaptivePolicy)}
DEFAULT_POLICY = "adaptive"   # a store's eviction unless told otherwise (edgemoe.loader.StoreOptions)


def make_policy(name: str, num_layers: int, popularity: dict[Key, float] | None = None, profile=None,
                routing: RoutingShape | None = None):
    """profile: the store's RoutingProfile (or None), for policies that predict. routing: the model's
    MoE layers and top-k, which adaptive eviction samples its ghosts by where there is no profile."""
    one_of(name, "policy=", sorted(POLICIES))
    if name == AdaptivePolicy.name:
        return AdaptivePolicy(num_layers, popularity, profile, routing=routing)
    return POLICIES[name](num_layers, popularity, profile)
