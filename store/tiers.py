"""TieredStore: disk -> RAM -> VRAM, each tier with a byte budget, a pluggable eviction policy,
a background loader for preloads, and counters.

Tiers are exclusive: an expert is resident in at most one of VRAM and RAM, so on unified-memory
devices (Jetson) nothing is counted twice. A load from disk goes to the fastest tier with a budget;
an expert evicted from VRAM moves down to RAM, one evicted from RAM is dropped. An expert larger
than a tier's whole budget is served without being cached ("streamed"): any budget gives correct
results, a budget smaller than one layer's active experts just re-reads them. The budget bounds the
cached bytes; an expert in use by the current step is also held by its caller until it is done.

Thread safety: one lock guards the tiers and counters; disk reads happen outside it, and a read in
flight is shared by every thread that asks for the same expert.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from edgemoe.errors import option_message
from edgemoe.quant import QuantizedTensor, dequantize_reference, get_format, group_layout

from .disk import DiskTier
from .format import ARRAY_NAMES, PROFILE, ExpertEntry, StoreError, decode_blob, read_manifest
from .guard import GUARD_WINDOW_TOKENS, GuardedPolicy, SchemeGuard
from .loads import LoadQueue
from .policies import make_policy
from .profile import RoutingProfile, read_profile_json

Key = tuple[int, int]


@dataclass
class ResidentExpert:
    """An expert's packed weights: in RAM (`tensors`, numpy, for the CPU kernels) or on a torch device
    (`device_tensors`, role -> packed/scale/zero; then `tensors` is None: no second copy on the host)."""

    entry: ExpertEntry
    tensors: dict[str, QuantizedTensor] | None
    nbytes: int
    device_tensors: dict[str, dict[str, torch.Tensor]] | None = None
    device: torch.device | None = None

    @property
    def key(self) -> Key:
        return self.entry.key

    @property
    def bits(self) -> int:
        return self.entry.bits

    def dequantize(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """gate [I, D], up [I, D], down [D, I] as dense tensors (on the device when resident there)."""
        if self.device_tensors is None:
            return {role: dequantize_reference(qt).to(dtype) for role, qt in self.tensors.items()}
        return {role: _dequantize_on_device(self.entry.tensors[role], t, dtype)
                for role, t in self.device_tensors.items()}


def to_device(tensors: dict[str, QuantizedTensor], device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """An expert's packed arrays copied to a torch device: role -> packed/scale/zero."""
    return {role: {name: torch.from_numpy(np.array(getattr(qt, name))).to(device) for name in ARRAY_NAMES}
            for role, qt in tensors.items()}


def device_swiglu(x: torch.Tensor, meta: dict[str, dict], on_device: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """The expert on x [S, D], dequantized and multiplied on the device holding `on_device`
    (meta: role -> {"shape", "bits", "group_size"}, as in the manifest)."""
    from edgemoe.layers import swiglu

    device = next(iter(on_device["gate"].values())).device
    w = {role: _dequantize_on_device(meta[role], t, torch.float32) for role, t in on_device.items()}
    return swiglu(x.to(device, torch.float32), w["gate"], w["up"], w["down"]).to(x.device, x.dtype)


def quantized_meta(tensors: dict[str, QuantizedTensor]) -> dict[str, dict]:
    return {role: {"shape": list(qt.shape), "bits": qt.bits, "group_size": qt.group_size}
            for role, qt in tensors.items()}


def _dequantize_on_device(meta: dict, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The torch twin of the dequantize kernel, run wherever the tensors are. meta: the manifest's record."""
    rows, cols = meta["shape"]
    group, _ = group_layout(meta["bits"], meta["group_size"], cols)
    codes = get_format(meta["bits"]).unpack(t["packed"], group)                 # [R, NG, G] on the device
    w = (codes.to(torch.float32) - t["zero"][..., None]) * t["scale"][..., None]
    return w.reshape(rows, -1)[:, :cols].to(dtype)


@dataclass
class TierStats:
    hits: int = 0
    evictions: int = 0
    bytes: int = 0          # resident now
    peak_bytes: int = 0


@dataclass
class StoreStats:
    vram: TierStats = field(default_factory=TierStats)
    ram: TierStats = field(default_factory=TierStats)
    misses: int = 0               # demand loads from disk
    streamed: int = 0             # served without caching (larger than a tier)
    disk_bytes_read: int = 0
    requested_bytes: int = 0      # bytes of the experts asked for (get), wherever they were served from
    preloads_issued: int = 0
    preloads_cancelled: int = 0   # still queued when the real routing was known
    preloads_loaded: int = 0
    preloads_used: int = 0        # preloaded, then asked for before eviction
    preloads_wasted: int = 0      # preloaded, evicted without use

    @property
    def requests(self) -> int:
        return self.vram.hits + self.ram.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return (self.vram.hits + self.ram.hits) / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        return {"requests": self.requests, "hit_rate": self.hit_rate, "vram": self.vram.__dict__,
                "ram": self.ram.__dict__, "misses": self.misses, "streamed": self.streamed,
                "disk_bytes_read": self.disk_bytes_read, "requested_bytes": self.requested_bytes,
                "preloads_issued": self.preloads_issued,
                "preloads_cancelled": self.preloads_cancelled, "preloads_loaded": self.preloads_loaded, "preloads_used": self.preloads_used,
                "preloads_wasted": self.preloads_wasted}


class _Tier:
    """A byte-budgeted map key -> ResidentExpert with an eviction policy."""

    def __init__(self, name: str, budget: int, policy, stats: TierStats):
        self.name, self.budget, self.policy, self.stats = name, budget, policy, stats
        self.items: OrderedDict[Key, ResidentExpert] = OrderedDict()

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget

    def put(self, item: ResidentExpert, protect: set[Key] = frozenset()) -> tuple[bool, list[ResidentExpert]]:
        """Insert, evicting by policy (never a protected key) until it fits. Returns whether it was
        inserted (not if only protected experts could make room) and the evicted items."""
        evicted = []
        while self.stats.bytes + item.nbytes > self.budget:
            candidates = [k for k in self.items if k not in protect]
            if not candidates:
                return False, evicted
            victim = self.items.pop(self.policy.victim(candidates))
            self.policy.remove(victim.key)
            self.stats.bytes -= victim.nbytes
            self.stats.evictions += 1
            evicted.append(victim)
        self.items[item.key] = item
        self.policy.insert(item.key)
        self.stats.bytes += item.nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes)
        return True, evicted

    def admit(self, preloads, protect: set[Key] = frozenset()) -> list[Key]:
        """Which of `preloads` ((key, nbytes, probability of use), most wanted first) are worth a
        read: each must fit in free room or in the room of victims the policy would pick (as put
        does, never a protected key nor another admitted preload's victim), and the policy must
        admit it (policy.admits, per victim; victim None in free room)."""
        free = self.budget - self.stats.bytes
        spoken_for = set(protect)
        admitted = []
        for key, nbytes, probability in preloads:
            victims, room = [], free
            while room < nbytes:
                pool = [k for k in self.items if k not in spoken_for and k not in victims]
                if not pool:
                    break
                victims.append(self.policy.victim(pool))
                room += self.items[victims[-1]].nbytes
            if room >= nbytes and all(self.policy.admits(probability, v) for v in victims or [None]):
                admitted.append(key)
                spoken_for.update(victims)
                free = room - nbytes
        return admitted

    def pop(self, key: Key) -> ResidentExpert:
        item = self.items.pop(key)
        self.policy.remove(key)
        self.stats.bytes -= item.nbytes
        return item


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(value: int | str | None, option: str, share_of: int | None = None,
              allow_share: bool = False) -> int | str | None:
    """'512MiB', '2GB', '1.5G', 1048576 -> bytes; '25%' -> that share of `share_of` bytes (a store's
    expert bytes). Without `share_of`, a valid share is returned as given (allow_share), to be resolved
    where the total is known. None stays None (no limit)."""
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 0:
            raise _option_error(option, value, "expected a size >= 0")
        return int(value)
    text = str(value).strip().lower()
    if text.endswith("%") and (allow_share or share_of is not None):
        share = _number(text[:-1])
        if share is None or not 0 <= share <= 100:
            raise _option_error(option, value, "expected a percentage in [0, 100]")
        return text if share_of is None else int(share / 100 * share_of)
    number = text.rstrip("kmgtib")
    amount, unit = _number(number), _UNITS.get(text[len(number):])
    if amount is None or unit is None or amount < 0:
        shares = " or a share of the store's expert bytes like 25%" if allow_share or share_of is not None else ""
        raise _option_error(option, value, f"expected a size like 512MiB, 2GB or 1048576{shares}")
    return int(amount * unit)


def _number(text: str) -> float | None:
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def check_device(value, option: str):
    """The VRAM tier's device, one this build of torch can use ('cuda', 'cuda:1', 'mps'; 'cpu' is a
    stand-in for tests). A torch.device or name; returned unchanged."""
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise _option_error(option, value, "not a torch device name (e.g. cuda, cuda:0, cpu)") from None
    if device.type == "cpu":
        return value
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if available is None or not available():
        raise _option_error(option, value, f"this torch build ({torch.__version__}) has no usable "
                                         f"{device.type} device")
    if device.index is not None and device.index >= module.device_count():
        raise _option_error(option, value, f"there are {module.device_count()} {device.type} devices")
    return value


def _option_error(option: str, value, expected: str) -> StoreError:
    return StoreError(option_message(option, value, expected))


class TieredStore:
    """A store opened with budgets. Use as a context manager, or call close()."""

    def __init__(self, path, ram: int | str | None = None, vram: int | str | None = 0,
                 device: str | torch.device | None = None, policy: str = "lru", io: str = "buffered",
                 verify: str = "first", preload_queue: int = 64, place_popular: bool = True,
                 profile: RoutingProfile | None = None, guard: bool = True):
        """profile: a routing profile to use instead of the store's profile.json (a benchmark's, built
        from the routing it replays). guard: with a RAM budget (and no VRAM tier), measure the scheme
        against a ghost on-demand LRU cache and fall back when it reads more (store/guard.py)."""
        self.manifest = read_manifest(Path(path))
        self.path = self.manifest.path
        self.spec = self.manifest.spec
        self.disk = DiskTier(self.manifest, io=io, verify=verify)
        self.stats = StoreStats()
        profile_json = read_profile_json(self.path / PROFILE) if profile is None else {
            "popularity": {str(l): row for l, row in profile.popularity.items()}}
        self.popularity = self._popularity(profile_json)
        ram_budget = parse_bytes(ram, "ram=", share_of=self.manifest.expert_bytes)
        vram_budget = parse_bytes(vram, "vram=", share_of=self.manifest.expert_bytes) or 0
        if vram_budget and device is None:
            device = "cuda" if torch.cuda.is_available() else None
            if device is None:
                raise StoreError(f"vram={vram!r}: no GPU here; give a device explicitly (device='cpu' is a "
                                 f"stand-in for tests)")
        check_device(device, "device=")
        self.device = torch.device(device) if vram_budget else None
        self.policy_name = policy
        # for the preloader and the policies that predict (expected-use)
        self.routing_profile = profile or RoutingProfile.from_profile_json(self.path / PROFILE, profile_json)
        make = lambda: make_policy(policy, self.spec.num_layers, self.popularity, self.routing_profile)  # noqa: E731
        self.vram = _Tier("vram", vram_budget, make(), self.stats.vram) if vram_budget else None
        self.guard = (SchemeGuard(ram_budget, GUARD_WINDOW_TOKENS * len(self.spec.moe_layer_ids))
                      if guard and ram_budget is not None and not vram_budget else None)
        ram_policy = GuardedPolicy(make(), self.guard) if self.guard else make()
        self.ram = _Tier("ram", ram_budget if ram_budget is not None else 1 << 62, ram_policy, self.stats.ram)
        self._lock = threading.RLock()
        self._in_flight: dict[Key, threading.Event] = {}
        self._preloaded: set[Key] = set()   # loaded on a prediction, not yet asked for
        self._urgent: set[Key] = set()      # loaded by prefetch(urgent=True), not yet asked for
        self._pinned: set[Key] = set()      # needed by the running layer (begin_layer)
        self._loads = LoadQueue(preload_queue)
        self._loader_error: BaseException | None = None
        self._closed = False
        self._loader = threading.Thread(target=self._load_loop, name="edgemoe-preload", daemon=True)
        self._loader.start()
        if place_popular and self.popularity:
            self._place_popular()

    # ---- public API -------------------------------------------------------------------------------
    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def experts(self) -> list[ExpertEntry]:
        return [self.manifest.experts[k] for k in sorted(self.manifest.experts)]

    def resident(self) -> dict[Key, str]:
        """Which experts are resident now, and where ("vram" or "ram")."""
        with self._lock:
            where = {k: "ram" for k in self.ram.items}
            if self.vram:
                where.update({k: "vram" for k in self.vram.items})
            return where

    def missing(self, keys) -> list[Key]:
        """The keys neither resident in a tier nor being read, in the order given."""
        with self._lock:
            return [k for k in keys if not self._present(k)]

    def get(self, layer: int, expert: int) -> ResidentExpert:
        """The expert, from the fastest tier holding it, else loaded from disk (and cached if it fits)."""
        self._raise_loader_error()
        key = (layer, expert)
        if key not in self.manifest.experts:
            raise StoreError(f"{self.path}: no expert {expert} in layer {layer}")
        with self._lock:
            self.stats.requested_bytes += self.manifest.experts[key].length
        while True:
            with self._lock:
                item = self._lookup(key)
                if item is not None:
                    self._loads.arrived(key)
                    return item
                event = self._in_flight.get(key)
                if event is None:
                    event = self._in_flight[key] = threading.Event()
                    break
            event.wait()   # another thread (the preloader) is reading it
            self._raise_loader_error()
        try:
            item = self._read(key)
            with self._lock:
                self.stats.misses += 1
                return self._place(item, kind="demand")
        finally:
            with self._lock:
                self._in_flight.pop(key).set()
            self._loads.arrived(key)

    def admit(self, predictions) -> list[Key]:
        """Of `predictions` ((key, probability of use), most wanted first), those worth a preload:
        neither resident nor being read, and admitted by the eviction policy of the tier an expert
        leaves the cache from (_Tier.admit), beside the running layer's experts and the unused
        preloads of the keys' layers. The simulator (tools/simulate_cache.py) asks the same."""
        if self.guard and not self.guard.allow_preload:
            return []
        with self._lock:
            wanted = [(key, self.manifest.experts[key].length, p) for key, p in predictions
                      if key in self.manifest.experts and not self._present(key)]
            layers = {key[0] for key, _, _ in wanted}
            protect = self._pinned | {k for k in self._preloaded if k[0] in layers}
            last = self.ram if self.ram.budget or self.vram is None else self.vram
            return last.admit(wanted, protect)

    def prefetch(self, keys, urgent: bool = False) -> None:
        """Ask the background loader for these experts, most wanted first; never blocks on I/O.
        urgent: needed by the layer running now (served before predictions, which wait until the
        running layer has every expert it began without: store/loads.py)."""
        self._raise_loader_error()
        for key in self.missing((int(l), int(e)) for l, e in keys):
            if not self._loads.put(key, urgent):
                return  # preloading is best effort: never stall the compute
            with self._lock:
                self.stats.preloads_issued += 1

    def begin_layer(self, layer: int, needed=()) -> None:
        """The model is about to run `layer`, which needs `needed` experts: eviction policies weigh
        layer distance, and nothing placed until the next begin_layer evicts a needed expert."""
        with self._lock:
            self._pinned = {(int(l), int(e)) for l, e in needed}
            if self.guard:
                self.guard.observe_layer(((k, self.manifest.experts[k].length) for k in sorted(self._pinned)),
                                         self.stats.disk_bytes_read)
            for tier in (self.vram, self.ram):
                if tier:
                    tier.policy.set_layer(layer, self._pinned)
            self._loads.await_layer(k for k in self._pinned if self._lookup(k, count=False) is None)

    def cancel_preloads(self, layer: int) -> None:
        """Drop the queued predictions for `layer` (not reads under way): its real routing is known now."""
        dropped = self._loads.cancel(layer)
        with self._lock:
            self.stats.preloads_cancelled += dropped

    def drain(self) -> None:
        """Wait until every queued preload is loaded (or failed); its error, if any, is raised."""
        self._loads.join()
        self._raise_loader_error()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loads.close()
        self._loader.join(timeout=5)
        self.disk.close()

    # ---- internals --------------------------------------------------------------------------------
    def _popularity(self, profile_json: dict) -> dict[Key, float]:
        if "popularity" not in profile_json:
            return {}
        try:
            return {(int(l), e): float(p) for l, row in profile_json["popularity"].items() for e, p in enumerate(row)}
        except (AttributeError, TypeError, ValueError) as exc:
            raise StoreError(f"{self.path / PROFILE}: malformed profile ({exc})") from None

    def _place_popular(self) -> None:
        """Fiddler's initial placement: the most popular experts in the fastest tiers, while they fit."""
        room = (self.vram.budget if self.vram else 0) + self.ram.budget
        for key in sorted(self.popularity, key=lambda k: -self.popularity[k]):
            entry = self.manifest.experts.get(key)
            if entry is None or entry.length > room:
                continue
            room -= entry.length
            with self._lock:
                self._place(self._read(key), kind="placement")

    def _lookup(self, key: Key, count: bool = True) -> ResidentExpert | None:
        for tier in (self.vram, self.ram):
            if tier and key in tier.items:
                if count:
                    self._count_request(tier, key)
                return tier.items[key]
        return None

    def _present(self, key: Key) -> bool:
        """Resident, or a read of it is under way (callers hold the lock)."""
        return key in self._in_flight or self._lookup(key, count=False) is not None

    def _count_request(self, tier: _Tier, key: Key) -> None:
        """A request served by `tier`: a hit, unless the expert was fetched for this very request
        (prefetch(urgent=True) overlaps the read with other compute, but it was not resident in time)."""
        tier.policy.touch(key)
        if key in self._urgent:
            self._urgent.discard(key)
            self.stats.misses += 1
            return
        tier.stats.hits += 1
        if key in self._preloaded:
            self._preloaded.discard(key)
            self.stats.preloads_used += 1

    def _read(self, key: Key) -> ResidentExpert:
        entry = self.manifest.experts[key]
        blob = self.disk.read(entry)
        with self._lock:
            self.stats.disk_bytes_read += entry.stored_length
        return ResidentExpert(entry, decode_blob(entry, blob), entry.length)

    def _place(self, item: ResidentExpert, kind: str) -> ResidentExpert:
        """Cache a freshly read expert in the fastest tier it fits; returns what the caller should use.
        kind: "demand" (asked for now: counts as a use), "preload", "urgent" or "placement"."""
        protect = self._protected(item.key)
        placed = False
        if self.vram and self.vram.fits(item.nbytes):
            on_device = self._to_device(item)
            placed, demoted = self.vram.put(on_device, protect)
            for d in demoted:
                self._put_ram(self._to_host(d), protect)
            if placed:
                item = on_device
        if not placed and self.ram.fits(item.nbytes):
            placed = self._put_ram(item, protect)
        if not placed:
            self.stats.streamed += 1
            return item
        if kind == "preload":
            self._preloaded.add(item.key)
        elif kind == "urgent":
            self._urgent.add(item.key)
        elif kind == "demand":
            tier = self.vram if item.device is not None else self.ram
            tier.policy.touch(item.key)
        return item

    def _protected(self, key: Key) -> set[Key]:
        """What placing `key` may not evict: the running layer's experts, and the unused preloads
        of key's own layer (a layer's preloads do not push each other out)."""
        return (self._pinned | {k for k in self._preloaded if k[0] == key[0]}) - {key}

    def _put_ram(self, item: ResidentExpert, protect: set[Key]) -> bool:
        placed, dropped = self.ram.put(item, protect) if self.ram.fits(item.nbytes) else (False, [])
        for d in dropped:
            self._forget(d.key)
        if not placed:
            self._forget(item.key)
        return placed

    def _forget(self, key: Key) -> None:
        self._urgent.discard(key)
        if key in self._preloaded:
            self._preloaded.discard(key)
            self.stats.preloads_wasted += 1

    def _to_device(self, item: ResidentExpert) -> ResidentExpert:
        return ResidentExpert(item.entry, None, item.nbytes, to_device(item.tensors, self.device), self.device)

    def _to_host(self, item: ResidentExpert) -> ResidentExpert:
        tensors = {}
        for role, t in item.device_tensors.items():
            meta = item.entry.tensors[role]
            arrays = {name: np.ascontiguousarray(t[name].cpu().numpy()).reshape(-1) for name in ARRAY_NAMES}
            tensors[role] = QuantizedTensor.from_arrays(meta["bits"], meta["group_size"], tuple(meta["shape"]), arrays)
        return ResidentExpert(item.entry, tensors, item.nbytes)

    def _load_loop(self) -> None:
        while (work := self._loads.get()) is not None:
            try:
                self._load_one(*work)
            finally:
                self._loads.task_done()

    def _load_one(self, key: Key, urgent: bool) -> None:
        with self._lock:
            if self._present(key):
                return
            event = self._in_flight[key] = threading.Event()
        try:
            item = self._read(key)
            with self._lock:
                if not urgent:
                    self.stats.preloads_loaded += 1
                self._place(item, kind="urgent" if urgent else "preload")
        except BaseException as exc:  # surfaced in the caller's thread by the next get/prefetch
            self._loader_error = exc
        finally:
            with self._lock:
                self._in_flight.pop(key)
            event.set()
            self._loads.arrived(key)

    def _raise_loader_error(self) -> None:
        if self._loader_error is not None:
            error, self._loader_error = self._loader_error, None
            raise error


def open_store(path, **options) -> TieredStore:
    """Open a store with tier budgets: open_store(path, ram="512MiB", vram=0, policy="lru"|"edgemoe")."""
    return TieredStore(path, **options)
