"""TieredStore: disk -> RAM -> VRAM, each tier with a byte capacity, an eviction policy, a background
loader for preloads, and counters.

What is resident where, and what to evict, is decided by an ExpertCache (edgemoe.scheduling.cache,
the same class the simulator replays traces through); this class does the I/O around it: reads from
disk (DiskTier), moves to and from the device, and the loader thread. Tiers are exclusive: an expert
is resident in at most one of VRAM and RAM, so on unified-memory devices (Jetson) nothing is counted
twice. Any capacity gives correct results: an expert larger than a whole tier is served without being
cached, and a capacity smaller than one layer's active experts just re-reads them. The capacity bounds
the cached bytes; an expert in use by the current step is also held by its caller until it is done.

Reads: a pool of reader threads (`readers`, READERS by default: chosen by measurement on this
project's disk, docs/scheduling.md "Reads in flight and demand first") takes reads from a LoadQueue
(store/loads.py): a layer's misses submitted together go to the readers at once, ahead of every
preload, or are left to the caller's own reads where those measure faster (ReadChoice); a preload
starts only while no demand is pending, and one under way pauses between its chunks while a
caller waits for another expert.

Thread safety: one lock guards the cache and counters; disk reads happen outside it, and a read in
flight is shared by every thread that asks for the same expert.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from edgemoe.kernels.device import dequantize_on_device, to_device, to_host
from edgemoe.kernels.ops import expert_layout
from edgemoe.options import OptionError, check_device, parse_bytes
from edgemoe.quant import QuantizedTensor, dequantize_reference
from edgemoe.scheduling.cache import CacheStats, ExpertCache, TierStats
from edgemoe.scheduling.guard import GUARD_WINDOW_TOKENS, SchemeGuard
from edgemoe.scheduling.policies import RoutingShape, make_policy
from edgemoe.scheduling.profile import RoutingProfile

from .disk import DiskTier
from .format import ExpertEntry, Manifest, StoreError, decode_blob, read_manifest
from .loads import LoadQueue, ReadChoice, reader_count
from .profile_file import (expert_popularity, find_routing_profile, read_popularity, read_predictor_choice,
                           read_profile_file)

Key = tuple[int, int]
PRELOAD_QUEUE = 64    # queued background reads at most: loading is best effort, never a backlog
_UNMADE = object()   # a layer table not made yet (None: made, and there is none)
READ_CHOICE_TOKENS = 2   # ReadChoice's window: this many tokens' layers (short: a decode of a few tokens chooses)


@dataclass
class ResidentExpert:
    """An expert's packed weights: in RAM (`tensors`, numpy, for the CPU kernels) or on a torch device
    (`device_tensors`, role -> packed/scale/zero; then `tensors` is None: no second copy on the host).
    narrowed: this is the store's fallback copy (entry is its fallback entry), not the expert itself.
    blob: the read buffer `tensors` view, recycled by the disk tier once the expert leaves the cache."""

    entry: ExpertEntry
    tensors: dict[str, QuantizedTensor] | None
    nbytes: int
    device_tensors: dict[str, dict[str, torch.Tensor]] | None = None
    device: torch.device | None = None
    narrowed: bool = False
    blob: np.ndarray | None = None

    @property
    def key(self) -> Key:
        return self.entry.key

    @property
    def bits(self) -> int:
        return self.entry.bits

    @cached_property
    def layout(self) -> np.ndarray:
        """This expert's row of the layer kernel's layout table (edgemoe.kernels.ops.expert_layout: SwiGLU,
        or ungated relu where it has no gate), made once per residency: valid while this object (which
        holds the arrays) lives."""
        return expert_layout(self.tensors.get("gate"), self.tensors["up"], self.tensors["down"])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """gate [I, D], up [I, D], down [D, I] as dense tensors (on the device when resident there)."""
        if self.device_tensors is None:
            return {role: dequantize_reference(qt).to(dtype) for role, qt in self.tensors.items()}
        return {role: dequantize_on_device(self.entry.tensors[role], t, dtype)
                for role, t in self.device_tensors.items()}


class StoreStats(CacheStats):
    """The cache's counters (hits per tier, misses, preloads used and wasted) and the store's I/O."""

    def __init__(self):
        super().__init__()
        self.disk_bytes_read = 0
        self.full_width_bytes_read = 0  # the same, a fallback copy's read counted as its expert's: what
                                        # the guard holds against its ghost (fallback savings are not the scheme's)
        self.requested_bytes = 0      # bytes of the experts asked for (get), wherever they were served from
        self.preloads_issued = 0
        self.preloads_cancelled = 0   # still queued when the real routing was known
        self.preloads_loaded = 0
        self.fallback_reads = 0       # reads of a narrower copy (get(..., fallback=True) on a miss)
        self.loader_cpu_seconds = 0.0  # the reader threads' CPU time, their reads included
        self.demand_wait_seconds = 0.0  # time callers of get() waited for a read (theirs or a reader's)

    @property
    def ram(self) -> TierStats:
        return self.tiers.get("ram", TierStats())

    @property
    def vram(self) -> TierStats:
        return self.tiers.get("vram", TierStats())

    def to_dict(self) -> dict:
        return {"requests": self.requests, "hit_rate": self.hit_rate, "vram": self.vram.__dict__,
                "ram": self.ram.__dict__, "misses": self.misses, "streamed": self.streamed,
                "disk_bytes_read": self.disk_bytes_read, "requested_bytes": self.requested_bytes,
                "preloads_issued": self.preloads_issued, "preloads_cancelled": self.preloads_cancelled,
                "preloads_loaded": self.preloads_loaded, "preloads_used": self.preloads_used,
                "preloads_wasted": self.preloads_wasted, "fallback_reads": self.fallback_reads,
                "loader_cpu_seconds": self.loader_cpu_seconds, "demand_wait_seconds": self.demand_wait_seconds}


class LayerLengths:
    """The experts' blob lengths by layer, summed per layer with no work per expert where a layer's
    experts all have one length (one width): right after a decode step's kernel the interpreter's
    caches are cold, and even a lookup per expert showed in a fine-grained model's step
    (docs/benchmarks.md, "thirteenth part")."""

    def __init__(self, manifest: Manifest):
        self.lengths: dict[int, dict[int, int]] = {}
        for (layer, expert), entry in manifest.experts.items():
            self.lengths.setdefault(layer, {})[expert] = entry.length
        self.same: dict[int, int | None] = {}   # layer -> its experts' one length, None where they differ
        for layer, row in self.lengths.items():
            distinct = set(row.values())
            self.same[layer] = distinct.pop() if len(distinct) == 1 else None

    def of(self, layer: int, experts) -> int:
        """The bytes of `experts` of `layer`."""
        same = self.same[layer]
        if same is not None:
            return same * len(experts)
        row = self.lengths[layer]
        return sum(row[e] for e in experts)


class TieredStore:
    """A store opened with tier capacities. Use as a context manager, or call close()."""

    def __init__(self, path, ram: int | str | None = None, vram: int | str | None = 0,
                 device: str | torch.device | None = None, policy: str = "lru", io: str = "direct",
                 place_popular: bool = True, routing_profile: RoutingProfile | None = None, guard: bool = True,
                 manifest: Manifest | None = None, readers: int | None = None, place_now: bool = True):
        """ram, vram: bytes, sizes like "512MiB", or shares of the store's expert bytes like "25%"
        (ram None: unlimited). routing_profile: one to use instead of the store's profile.json
        (a benchmark's, built from the routing it replays). guard: with a RAM capacity (and no VRAM
        tier), measure the scheme against a ghost on-demand LRU cache and fall back when it reads
        more (edgemoe.scheduling.guard). manifest: the store's manifest, already parsed (the converter
        opens the store it writes before its manifest is on disk). readers: reads in flight from the
        background (None: $EDGEMOE_READERS, else READERS). place_now: place the popular experts (every
        expert, for a RAM budget that holds them all) here; False leaves it to place(), for a loader
        that first loads other weights."""
        self.manifest = manifest if manifest is not None else read_manifest(Path(path))
        self._lengths = LayerLengths(self.manifest)   # served_resident's
        self.path = self.manifest.path
        self.spec = self.manifest.spec
        ram_capacity = parse_bytes(ram, "ram=", share_of=self.manifest.expert_bytes)
        vram_capacity = parse_bytes(vram, "vram=", share_of=self.manifest.expert_bytes) or 0
        self.ram_capacity, self.vram_capacity = ram_capacity, vram_capacity   # bytes (RAM: None, unlimited)
        self.device = self._vram_device(vram, vram_capacity, device)
        # predictor_choice: the predictor the store's profiling measured better (preload="auto")
        if routing_profile is not None:
            self.routing_profile, self.popularity = routing_profile, expert_popularity(routing_profile.popularity)
            self.predictor_choice = None
        else:
            profile_json = read_profile_file(self.path)     # read once for all three
            self.routing_profile = find_routing_profile(self.path, profile_json)
            self.popularity = read_popularity(self.path, profile_json)
            self.predictor_choice = read_predictor_choice(self.path, profile_json)
        self.disk = DiskTier(self.manifest, io=io)
        self.stats = StoreStats()
        unlimited = 1 << 62
        tiers = ([("vram", vram_capacity)] if vram_capacity else []) + [
            ("ram", ram_capacity if ram_capacity is not None else unlimited)]
        # A RAM tier that holds every expert never evicts: no policy has anything to choose, and
        # no scheme anything to guard. Adaptive eviction's ghosts would update every candidate
        # policy on every request for nothing, so the cheapest policy keeps the order.
        holds_all = not vram_capacity and (ram_capacity is None or ram_capacity >= self.manifest.expert_bytes)
        policy = "lru" if holds_all else policy
        guarded = guard and ram_capacity is not None and not vram_capacity and not holds_all
        self._layer_tables: dict[int, np.ndarray | None] = {}   # resident_layer_table's, until an item enters or leaves
        self._stacked_tables: tuple[int, np.ndarray] | None = None   # resident_tables' (first, tables), as long
        self.cache = ExpertCache(
            tiers, lambda: make_policy(policy, self.spec.num_layers, self.popularity, self.routing_profile,
                                       RoutingShape(self.spec.moe_layer_ids, self.spec.top_k)),
            guard=SchemeGuard(ram_capacity, GUARD_WINDOW_TOKENS * len(self.spec.moe_layer_ids)) if guarded else None,
            enter=self._enter, stats=self.stats, leave=self._leave)
        self._lock = threading.RLock()
        self._weak: set[Key] = set()     # the running layer's experts a fallback copy will do for
        self._in_flight: dict[Key, threading.Event] = {}
        self._loads = LoadQueue(PRELOAD_QUEUE)
        self._loader_error: BaseException | None = None
        self._closed = False
        self.readers = reader_count(readers)
        self.read_choice = ReadChoice(READ_CHOICE_TOKENS * max(1, len(self.spec.moe_layer_ids)))
        self._needed_bytes_read = 0      # by demand and urgent reads (not preloads): ReadChoice's bytes
        self._choice_start = (0.0, 0)    # (callers' wait, needed bytes read) when the last layer began
        self._loaders = [threading.Thread(target=self._load_loop, name=f"edgemoe-reader-{i}", daemon=True)
                         for i in range(self.readers)]
        for loader in self._loaders:
            loader.start()
        self._placement_due = place_popular
        self._fill = holds_all and ram_capacity is not None
        if place_now:
            self.place()

    # ---- public API -------------------------------------------------------------------------------
    def place(self) -> None:
        """Place the most popular experts (place_popular), once. A RAM budget that holds every expert
        (the commands' --ram auto on a machine with room for them) is filled at once; without a
        budget (None: unlimited) experts are read on first use."""
        if self._placement_due and (self.popularity or self._fill):
            self._place_popular(everything=self._fill)
            self._choice_start = (0.0, self._needed_bytes_read)   # placement is no layer's read
        self._placement_due = False

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def guard(self) -> SchemeGuard | None:
        return self.cache.guard

    def experts(self) -> list[ExpertEntry]:
        return [self.manifest.experts[k] for k in sorted(self.manifest.experts)]

    def resident(self) -> dict[Key, str]:
        """Which experts are resident now, and where ("vram" or "ram")."""
        with self._lock:
            return self.cache.resident()

    def holds_everything(self) -> bool:
        """Every expert of the store is resident: no read can be needed, nor any preload."""
        return self.cache.count() == len(self.manifest.experts)

    def resident_layer_table(self, layer: int) -> np.ndarray | None:
        """The layer kernel's layout table of `layer`'s experts (int64 [E, LAYOUT_COLUMNS], row e for
        expert e: edgemoe.kernels.ops.expert_layout), when every expert of the store is resident in RAM
        at full width: then nothing is read, placed or evicted any more, and a decode step finds its
        experts' rows by indexing, with no per-expert bookkeeping. None otherwise. Made once per layer,
        dropped whenever an item enters or leaves the cache (a leaving item's buffer may be reused)."""
        table = self._layer_tables.get(layer, _UNMADE)
        if table is _UNMADE:
            with self._lock:
                table = self._make_layer_table(layer) if self.holds_everything() else None
                self._layer_tables[layer] = table
        return table

    def resident_tables(self, first: int = 0) -> np.ndarray | None:
        """The resident_layer_tables of layers first..L-1 stacked (int64 [L - first, E, LAYOUT_COLUMNS])
        when each of them has one (a decode step's kernel then runs all of them), else None; made once
        per `first`, dropped as they are."""
        made = self._stacked_tables
        if made is not None and made[0] == first:
            return made[1]
        layers = range(first, self.spec.num_layers)
        tables = [self.resident_layer_table(l) for l in layers]
        if not tables or any(t is None for t in tables):
            return None
        with self._lock:
            if not all(l in self._layer_tables for l in layers):   # an item entered or left meanwhile
                return None
            stacked = np.stack(tables)
            self._stacked_tables = (first, stacked)
        return stacked

    def _drop_layer_tables(self) -> None:
        self._layer_tables.clear()
        self._stacked_tables = None

    def _make_layer_table(self, layer: int) -> np.ndarray | None:
        items = [self.cache.find((layer, e)) for e in range(self.spec.num_experts)]
        if any(item is None or item.narrowed or item.tensors is None for item in items):
            return None
        return np.stack([item.layout for item in items])

    def missing(self, keys) -> list[Key]:
        """The keys neither resident in a tier nor being read, in the order given."""
        with self._lock:
            return [k for k in keys if not self._present(k)]

    def get(self, layer: int, expert: int, fallback: bool = False) -> ResidentExpert:
        """The expert, from the fastest tier holding it, else loaded from disk (and cached if it fits).
        fallback: its narrower copy will do (a weakly chosen expert): a resident copy of either width
        is served, and a miss reads the fallback copy when the store has one. Without it, a resident
        fallback copy is replaced by the expert read in full."""
        self._raise_loader_error()
        key = (layer, expert)
        if key not in self.manifest.experts:
            raise StoreError(f"{self.path}: no expert {expert} in layer {layer}")
        with self._lock:
            self.stats.requested_bytes += self.manifest.experts[key].length
        while True:
            with self._lock:
                self._drop_narrowed_unless(fallback, key)
                item = self.cache.request(key)
                if item is not None:
                    self._loads.arrived([key])
                    return item
                event = self._in_flight.get(key)
                if event is None:
                    event = self._in_flight[key] = threading.Event()
                    break
            with self._waiting_for(key):
                event.wait()   # a reader thread is reading it
            self._raise_loader_error()
        try:
            with self._waiting_for(key):
                item = self._read(key, narrowed=fallback)
            with self._lock:
                return self.cache.place(item, kind="demand")
        finally:
            with self._lock:
                self._in_flight.pop(key).set()
            self._loads.arrived([key])

    def get_resident(self, layer: int, experts, fallback=frozenset()) -> list[ResidentExpert | None]:
        """get() for each of a layer's experts that is resident, under one lock (a step asks for many):
        its item, counted as get() counts it; None for one that get() would have to read (or whose
        resident fallback copy will not do: fallback holds the experts a copy does for)."""
        self._raise_loader_error()
        served = []
        with self._lock:
            for expert in experts:
                key = (layer, expert)
                item = self.cache.find(key)
                if item is None or (item.narrowed and expert not in fallback):
                    served.append(None)
                    continue
                self.stats.requested_bytes += self.manifest.experts[key].length
                served.append(self.cache.request(key))
        self._loads.arrived([(layer, e) for e, item in zip(experts, served) if item is not None])
        return served

    def admit(self, predictions) -> list[Key]:
        """Of `predictions` ((key, probability of use), most wanted first), those worth a preload:
        neither resident nor being read, and admitted by the cache (ExpertCache.admit)."""
        with self._lock:
            return self.cache.admit((key, self.manifest.experts[key].length, p) for key, p in predictions
                                    if key in self.manifest.experts and not self._present(key))

    def prefetch(self, keys, urgent: bool = False) -> None:
        """Ask the background loader for these experts, most wanted first; never blocks on I/O.
        urgent: needed by the layer running now (served before predictions, which wait until no
        demand is pending: edgemoe/store/loads.py); a layer's misses given together are read by
        the pool of readers at once, unless the caller's own reads measure faster (read_choice:
        then nothing is queued and get() reads each)."""
        self._raise_loader_error()
        if urgent and not self.read_choice.submit:
            return
        with self._lock:   # an urgent read also replaces a fallback copy the running layer cannot use
            wanted = [k for k in ((int(l), int(e)) for l, e in keys) if not self._present(k, full=urgent)]
        for key in wanted:
            if not self._loads.put(key, urgent):
                return  # preloading is best effort: never stall the compute
            with self._lock:
                self.stats.preloads_issued += 1

    def begin_layer(self, layer: int, needed=(), weak=()) -> None:
        """The model is about to run `layer`, which needs `needed` experts: eviction policies weigh
        layer distance, and nothing placed until the next begin_layer evicts a needed expert. weak:
        those of them a fallback copy will do for (the loader reads those copies for them)."""
        with self._lock:
            self._weak = {(int(l), int(e)) for l, e in weak}
            keys = sorted({(int(l), int(e)) for l, e in needed})
            if self.guard is not None:   # before the layer's bytes: the guard judges a window on both
                self.guard.observe_time(self.stats.demand_wait_seconds, self.stats.preloads_loaded,
                                        self.disk.read_seconds / self.disk.bytes_read if self.disk.bytes_read else None)
            wait, read = self.stats.demand_wait_seconds, self._needed_bytes_read
            self.read_choice.observe_layer(wait - self._choice_start[0], read - self._choice_start[1])
            self._choice_start = (wait, read)
            self.cache.begin_layer(layer, {k: self.manifest.experts[k].length for k in keys},
                                   self.stats.full_width_bytes_read)
            self._loads.await_layer(k for k in keys if not self._serves(k))

    def served_resident(self, first_layer: int, chosen: list[list[int]]) -> None:
        """Layers first_layer, first_layer + 1, ... computed the experts chosen[0], chosen[1], ...
        (each ascending) while every expert was resident (resident_layer_table): the counts begin_layer
        and get_resident would make for them (a hit per request, the bytes requested), in bulk under
        one lock. Nothing is read, awaited, timed or evicted any more, so neither the policies nor the
        guard are told (ExpertCache.count_hits)."""
        with self._lock:
            self._weak = set()
            self.stats.requested_bytes += sum(self._lengths.of(layer, experts)
                                              for layer, experts in enumerate(chosen, first_layer))
            self.cache.count_hits(first_layer, chosen)

    def cancel_preloads(self, layer: int) -> None:
        """Drop the queued predictions for `layer` (not reads under way): its real routing is known now."""
        dropped = self._loads.cancel(layer)
        with self._lock:
            self.stats.preloads_cancelled += dropped

    def ram_filled(self) -> tuple[int, int]:
        """The RAM tier's (cached bytes, capacity) now."""
        with self._lock:
            ram = self.cache.tiers[-1]
            return ram.stats.bytes, ram.capacity

    def resize_ram(self, capacity: int) -> None:
        """Let the RAM tier cache up to `capacity` bytes from now on: --ram auto's second look
        (edgemoe.ram_growth) grows it, and returns it to its first size when the sequence ends (made
        smaller, it evicts by its policy). Experts enter new room as they are read: placing the
        profile's most popular ones in it at once missed more (docs/scheduling.md)."""
        with self._lock:
            self.cache.resize_last_tier(capacity)
            self.ram_capacity = capacity

    def drain(self) -> None:
        """Wait until every queued preload is loaded (or failed); its error, if any, is raised."""
        self._loads.join()
        self._raise_loader_error()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loads.close()
        for loader in self._loaders:
            loader.join(timeout=5)
        self.disk.close()
        # Its experts go now: the store sits in reference cycles (its callbacks, its threads) that
        # only the cyclic collector frees, and a process that opens another store meanwhile (a
        # benchmark's next run, a server's reload) would hold both.
        with self._lock:
            self._drop_layer_tables()
            self.cache.clear()

    # ---- internals --------------------------------------------------------------------------------
    def _vram_device(self, vram, vram_capacity: int, device) -> torch.device | None:
        if vram_capacity and device is None:
            device = "cuda" if torch.cuda.is_available() else None
            if device is None:
                raise OptionError("vram=", vram, "no GPU here; name the VRAM tier's device (device=, --device; "
                                  "cpu is a stand-in for tests)")
        check_device(device, "device=")
        return torch.device(device) if vram_capacity else None

    def _place_popular(self, everything: bool = False) -> None:
        """Fiddler's initial placement: the most popular experts in the fastest tiers, while they fit;
        everything: a RAM tier that holds every expert gets every one, the profile's most popular
        first (a decode step then runs whole in the decode engine's kernel from its first token,
        where experts read on first use might never all be resident)."""
        room = sum(tier.capacity for tier in self.cache.tiers)
        keys = sorted(self.popularity, key=lambda k: -self.popularity[k])
        if everything:
            keys += [k for k in self.manifest.experts if k not in self.popularity]
        for key in keys:
            entry = self.manifest.experts.get(key)
            if entry is None or entry.length > room:
                continue
            room -= entry.length
            with self._lock:
                self.cache.place(self._read(key), kind="placement")

    def _present(self, key: Key, full: bool = False) -> bool:
        """Resident, or a read of it is under way (callers hold the lock). full: a fallback copy
        counts only for a key the running layer takes weakly."""
        if key in self._in_flight:
            return True
        return self._serves(key) if full else self.cache.find(key) is not None

    def _serves(self, key: Key) -> bool:
        """What is resident of `key` will do for the running layer: the expert, or its fallback copy
        for a weakly chosen one (callers hold the lock)."""
        item = self.cache.find(key)
        return item is not None and (not item.narrowed or key in self._weak)

    @contextlib.contextmanager
    def _waiting_for(self, key: Key):
        """A caller reads `key` or waits for its read: demand (no preload starts meanwhile), timed."""
        start = time.perf_counter()
        try:
            with self._loads.demand(key):
                yield
        finally:
            with self._lock:
                self.stats.demand_wait_seconds += time.perf_counter() - start

    def _read(self, key: Key, narrowed: bool = False, preload: bool = False) -> ResidentExpert:
        """Read the expert, or its fallback copy when `narrowed` and the store has one. preload: in
        chunks, pausing between them while a caller waits for another expert."""
        narrowed = narrowed and key in self.manifest.fallback
        entry = self.manifest.fallback[key] if narrowed else self.manifest.experts[key]
        blob = self.disk.read(entry, pause=(lambda: self._loads.wait_for_idle_disk(key)) if preload else None)
        with self._lock:
            self.stats.disk_bytes_read += entry.stored_length
            self._needed_bytes_read += 0 if preload else entry.stored_length
            self.stats.full_width_bytes_read += self.manifest.experts[key].stored_length
            self.stats.fallback_reads += narrowed
        return ResidentExpert(entry, decode_blob(entry, blob), entry.length, narrowed=narrowed, blob=blob)

    def _leave(self, item: ResidentExpert) -> None:
        """item left the cache (or was served without entering it): its read buffer may be reused, so
        no layer table may hold its addresses."""
        self._drop_layer_tables()
        if item.blob is not None:
            self.disk.release(item.blob)

    def _drop_narrowed_unless(self, fallback: bool, key: Key) -> None:
        """A request that needs the expert itself finds its fallback copy resident: drop the copy, so
        that the request reads the expert in full (callers hold the lock)."""
        item = self.cache.find(key)
        if item is not None and item.narrowed and not fallback:
            self.cache.discard(key)

    def _enter(self, item: ResidentExpert, tier: str) -> ResidentExpert:
        """item as the tier holds it: on the device for "vram", in host memory for "ram"."""
        self._drop_layer_tables()
        if tier == "vram" and item.device is None:
            return ResidentExpert(item.entry, None, item.nbytes, to_device(item.tensors, self.device), self.device,
                                  item.narrowed)
        if tier == "ram" and item.device is not None:
            return ResidentExpert(item.entry, to_host(item.entry.tensors, item.device_tensors), item.nbytes,
                                  narrowed=item.narrowed)
        return item

    def _load_loop(self) -> None:
        while (work := self._loads.get()) is not None:
            cpu = time.thread_time()
            try:
                self._load_one(*work)
            finally:
                with self._lock:
                    self.stats.loader_cpu_seconds += time.thread_time() - cpu
                self._loads.task_done()

    def _load_one(self, key: Key, urgent: bool) -> None:
        with self._lock:
            if self._present(key, full=urgent):
                return
            event = self._in_flight[key] = threading.Event()
            narrowed = urgent and key in self._weak
        try:
            item = self._read(key, narrowed, preload=not urgent)
            with self._lock:
                if not urgent:
                    self.stats.preloads_loaded += 1
                self._drop_narrowed_unless(narrowed, key)   # the expert replaces its fallback copy
                self.cache.place(item, kind="urgent" if urgent else "preload")
        except BaseException as exc:  # surfaced in the caller's thread by the next get/prefetch
            self._loader_error = exc
        finally:
            with self._lock:
                self._in_flight.pop(key)
            event.set()
            self._loads.arrived([key])

    def _raise_loader_error(self) -> None:
        if self._loader_error is not None:
            error, self._loader_error = self._loader_error, None
            raise error


def open_store(path, **options) -> TieredStore:
    """Open a store with tier capacities: open_store(path, ram="512MiB", vram=0, policy="lru"|"lfu"|...)."""
    return TieredStore(path, **options)
