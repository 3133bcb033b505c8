"""`edgemoe bench STORE`: time to first token and decode speed of a store under a RAM capacity, in
three modes run by one harness on the same store, next to the physical limit of each run
(contract: docs/benchmarks.md, "edgemoe bench").

Modes:
- "all-in-ram": every expert read into RAM before timing; the no-I/O bound.
- "on-demand-lru": the RAM capacity, LRU eviction, no preload and no overlap of reads with compute
  (EdgeMoE's IO-EXP baseline, Mixtral-offloading's scheme).
- "predictive": the RAM capacity and the store's default scheme (StoreOptions' defaults: adaptive
  eviction, the preload predictor chosen for the store, the guard), popularity placement at load,
  the store's routing profile (or the bench's), and reads overlapped with compute; with
  `skip_below` / `fallback_below`, also those quality trade-offs; with `policy` / `preload`, that
  eviction policy or predictor instead of the default's (to break the scheme's cost down).

A run: a fresh store (empty RAM tier; `cold` first drops the store's files from the page cache),
a prompt of L tokens fed in chunks (time to first token: up to the first token chosen), then
`warmup_tokens` greedy decode steps, then `decode_tokens` timed ones. Hit rate and disk bytes are
counted over the timed decode steps only; a record holds the medians over `repeats` runs.

The physical limit of a run: per decoded token the compute must read the dense weights and every
expert it uses from memory, and whatever the disk tier read (preloads included) from disk, so
limit_decode_tok_s = 1 / max(disk bytes / disk bandwidth, memory bytes / memory bandwidth), with
both bandwidths measured by the same invocation. The max, not the sum: a scheme that overlaps
reads with compute perfectly could reach it.
"""

from __future__ import annotations

import errno
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

MODES = ("all-in-ram", "on-demand-lru", "predictive")
RECORD_FIELDS = ("mode", "ram_bytes", "prefill_tokens", "ttft_s", "decode_tok_s", "hit_rate",
                 "disk_bytes_per_token", "limit_decode_tok_s")


@dataclass
class BenchConfig:
    ram: int | str                             # RAM capacity for experts, bytes or "auto" (all-in-ram ignores it)
    modes: Sequence[str] = MODES
    prefill_tokens: Sequence[int] = (512, 2048)
    decode_tokens: int = 32
    warmup_tokens: int = 4
    repeats: int = 3
    cold: bool = False
    replay: object | None = None               # an edgemoe.replay.RoutingReplay routing every run
    prefill_chunk: int = 512
    io: str = "direct"                         # the disk tier's reads (edgemoe.store.disk)
    dtype: object | None = None                # dense weight matrices (None: as the store keeps them)
    dense_bits: int | str | None = "auto"      # the dense projections at load (edgemoe.dense.dense_bits_for)
    kv_dtype: str = "float32"                   # the KV cache's element type (edgemoe.kv_cache.KV_DTYPES)
    seed: int = 0
    threads: int | None = None                 # the kernels' threads (None: the cores left free)
    routing_profile: object | None = None      # a RoutingProfile for the predictive mode instead of the store's
    compute: str = "auto"                      # the experts' compute path (edgemoe.quantized)
    skip_below: float = 0.0                    # the predictive mode's quality trade-offs (StoreOptions):
    fallback_below: float = 0.0                # adaptive top-k and fallback copies (off by default)
    policy: str | None = None                  # the predictive mode's eviction and predictor instead of the
    preload: str | None = None                 # store's defaults (a breakdown of the scheme's parts)

    def __post_init__(self):
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"--mode {unknown[0]!r}: expected one of {MODES}")
        if self.decode_tokens < 1 or self.repeats < 1 or self.warmup_tokens < 0:
            raise ValueError("--decode-tokens and --repeats must be at least 1, --warmup-tokens at least 0")
        if not self.prefill_tokens or min(self.prefill_tokens) < 1:
            raise ValueError("--prefill: give prompt lengths of at least 1 token")


@dataclass
class Bandwidths:
    memory: float                              # bytes/s, the best of a numba and a torch parallel sum
    disk: float                                # bytes/s, cold reads of the store's blobs, best of 1 and 2 readers
    detail: dict = field(default_factory=dict)


# ---- the machine ------------------------------------------------------------------------------------

def drop_store_from_page_cache(store_path: Path) -> None:
    """Make the store cold: every file of it out of the page cache."""
    from edgemoe.store.disk import drop_page_cache

    for path in sorted(Path(store_path).iterdir()):
        if path.is_file():
            drop_page_cache(path)


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> tuple[float, dict]:
    """Read bandwidth (bytes/s): parallel sums over nbytes of float32, the better of numba and torch."""
    from edgemoe.kernels.cpu import parallel_sum
    from .latency import median_time

    a = np.ones((nbytes // 4 // 4096, 4096), dtype=np.float32)
    t = torch.from_numpy(a)
    detail = {"numba_sum": a.nbytes / median_time(lambda: parallel_sum(a), repeats),
              "torch_sum": a.nbytes / median_time(lambda: t.sum(), repeats)}
    return max(detail.values()), detail


def disk_bandwidth(store_path: Path, sample_bytes: int = 512 << 20, seed: int = 0) -> tuple[float, dict]:
    """Cold read bandwidth (bytes/s) of the store's expert blobs in random order, one blob per read
    as the disk tier reads them, with 1 and 2 readers; the better of the two."""
    from edgemoe.store import read_manifest

    entries = list(read_manifest(Path(store_path)).experts.values())
    random.Random(seed).shuffle(entries)
    sample, total = [], 0
    for e in entries:
        if total >= sample_bytes:
            break
        sample.append(e)
        total += e.stored_length
    detail = {f"{readers}_readers": _cold_read(Path(store_path), sample, readers) for readers in (1, 2)}
    return max(detail.values()), detail


def _cold_read(store_path: Path, entries: list, readers: int) -> float:
    drop_store_from_page_cache(store_path)
    fds = {name: os.open(store_path / name, os.O_RDONLY) for name in {e.file for e in entries}}
    pending = list(entries)
    lock = threading.Lock()

    def reader():
        buf = np.empty(max(e.stored_length for e in entries), np.uint8)
        while True:
            with lock:
                if not pending:
                    return
                e = pending.pop()
            os.preadv(fds[e.file], [memoryview(buf)[:e.stored_length]], e.offset)
            os.posix_fadvise(fds[e.file], e.offset, e.stored_length, os.POSIX_FADV_DONTNEED)

    start = time.perf_counter()
    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    return sum(e.stored_length for e in entries) / seconds


def measure_bandwidths(store_path: Path) -> Bandwidths:
    memory, memory_detail = memory_bandwidth()
    disk, disk_detail = disk_bandwidth(store_path)
    return Bandwidths(memory, disk, {"memory": memory_detail, "disk": disk_detail})


def machine_summary(bw: Bandwidths, memory_limit: str | None = None) -> str:
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return (f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}; memory read "
            f"{bw.memory / 1e9:.1f} GB/s, cold disk read {bw.disk / 1e9:.2f} GB/s"
            + (f"; inside a memory limit of {memory_limit}" if memory_limit else ""))


def parse_ram(value: str, store_path: Path) -> int | str:
    """--ram: bytes ("1GiB", "800MB", "123456"), a share of the store's expert bytes ("25%"), or
    "auto": sized when each run's store opens, as `edgemoe run` sizes it (edgemoe.loader.auto_ram),
    for the run's tokens of KV cache."""
    from edgemoe.store import parse_bytes, read_manifest

    if value == "auto":
        return value
    return parse_bytes(value, "--ram", share_of=read_manifest(Path(store_path)).expert_bytes)


CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")


def confine_memory(limit: str, root: Path = CGROUP_V1_MEMORY) -> Path:
    """Move this process into a new cgroup v1 memory group limited to `limit` (page cache counts):
    a RAM limit then holds for everything the process touches. Linux, root, cgroup v1 only."""
    from edgemoe.store import parse_bytes

    nbytes = parse_bytes(limit, "--memory-limit")
    if not (root / "cgroup.procs").exists():
        raise ValueError(f"--memory-limit: no cgroup v1 memory controller at {root}")
    group = root / f"edgemoe-bench-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(nbytes))
        _move_charges(group)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        raise ValueError(f"--memory-limit: cannot set up {group} ({e.strerror}; it needs root)") from None
    return group


def leave_memory_group(group: Path) -> tuple[int, int]:
    """Move this process back to the parent group and remove `group` (confine_memory's); returns the
    group's peak memory use in bytes and how often the limit was hit (memory.failcnt: each time the
    kernel had to reclaim to stay under it). A group that cannot be removed is named on stderr."""
    peak, hits = (int((group / name).read_text()) for name in ("memory.max_usage_in_bytes", "memory.failcnt"))
    (group.parent / "cgroup.procs").write_text(str(os.getpid()))
    try:
        group.rmdir()
    except OSError as e:
        print(f"--memory-limit: could not remove {group} ({e.strerror}); remove it with rmdir", file=sys.stderr)
    return peak, hits


def remove_memory_group(group: Path, seconds: float = 10.0) -> None:
    """rmdir a cgroup v1 group another process ran in, waiting for it to empty: a process the kernel
    killed for memory can still be tearing down after its parent saw it end, and rmdir then fails
    with EBUSY."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            group.rmdir()
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _move_charges(group: Path) -> None:
    """Charge the memory this process already uses to the group too, where the kernel still allows
    it (cgroup v1 move_charge_at_immigrate; newer kernels refuse: then only later use counts)."""
    try:
        (group / "memory.move_charge_at_immigrate").write_text("3")
    except OSError:
        pass


# ---- one run ----------------------------------------------------------------------------------------

def store_options(mode: str, config: "BenchConfig"):
    from .loader import StoreOptions

    run = dict(io=config.io, compute=config.compute)
    if mode == "all-in-ram":
        return StoreOptions(ram=None, policy="lru", preload="none", place_popular=False, **run)
    if mode == "on-demand-lru":
        return StoreOptions(ram=config.ram, policy="lru", preload="none", place_popular=False, **run)
    chosen = {name: value for name, value in (("policy", config.policy), ("preload", config.preload)) if value}
    return StoreOptions(ram=config.ram, place_popular=True, routing_profile=config.routing_profile,
                        skip_below=config.skip_below, fallback_below=config.fallback_below, **chosen, **run)


def open_model(store_path: Path, mode: str, config: BenchConfig):
    import edgemoe

    context = max(config.prefill_tokens) + config.warmup_tokens + config.decode_tokens   # what ram="auto" reserves
    model = edgemoe.load(store_path, config.dtype, config.threads, store=store_options(mode, config),
                         dense_bits=config.dense_bits, context=context, kv_dtype=config.kv_dtype)
    if config.replay is not None:
        config.replay.attach(model)
    if mode == "all-in-ram":
        store = model.store
        for entry in store.experts():
            store.get(*entry.key)
    return model


def dense_bytes_per_token(model) -> int:
    """Bytes of dense weights every token reads: every layer's non-expert tensors, final norm, LM head."""
    layers = sum(t.nbytes for w in model.layers for t in w.values())
    return layers + model.final_norm.nbytes + model.lm_head.nbytes


def _counters(model) -> dict:
    store = model.store
    s, t = store.stats, model.timings
    return {"requests": s.requests, "hits": s.vram.hits + s.ram.hits, "disk_bytes": s.disk_bytes_read,
            "disk_reads": store.disk.reads, "requested_bytes": s.requested_bytes,
            "io_wait": model.experts.io_wait_seconds, "attention": t.attention, "experts": t.experts,
            "layers": t.layers,
            "preloads_loaded": s.preloads_loaded, "preloads_used": s.preloads_used,
            "skipped": model.experts.skipped, "fallback_uses": model.experts.fallback_uses,
            "read_cpu": store.disk.read_cpu_seconds, "loader_cpu": s.loader_cpu_seconds}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def limit_tok_s(disk_bytes: float, memory_bytes: float, bw: Bandwidths) -> float:
    """Decode tokens/s if moving a token's bytes were all it took (disk and memory overlapped)."""
    return 1 / max(disk_bytes / bw.disk, memory_bytes / bw.memory)


def run_once(store_path: Path, mode: str, prompt: list[int], config: BenchConfig, bw: Bandwidths) -> dict:
    """One cold run of one mode: prefill `prompt`, then decode; the raw figures of the record."""
    from .model import Segment

    if config.cold:
        drop_store_from_page_cache(store_path)
    start = time.perf_counter()
    model = open_model(store_path, mode, config)
    load_s = time.perf_counter() - start
    store = model.store
    try:
        cache = model.new_cache()
        chunk = config.prefill_chunk
        before = _counters(model)
        start = time.perf_counter()
        chunk_reads = []
        for i in range(0, len(prompt), chunk):
            reads = store.disk.reads
            piece = torch.tensor(prompt[i:i + chunk])
            # The last position's logits only, as generation computes a prompt's (and llama-bench's)
            logits = model.forward(piece, [Segment(cache, piece.numel())], last_only=True)
            chunk_reads.append(store.disk.reads - reads)
        token = int(logits[-1].argmax())
        ttft = time.perf_counter() - start
        prefill = _delta(_counters(model), before)
        step = _decode_step(model, store, cache, len(prompt) + config.warmup_tokens + config.decode_tokens)
        for _ in range(config.warmup_tokens):
            token = step(token)
        before = _counters(model)
        start = time.perf_counter()
        for _ in range(config.decode_tokens):
            token = step(token)
        seconds = time.perf_counter() - start
        decode = _delta(_counters(model), before)
    finally:
        model.close()
    n = config.decode_tokens
    disk_per_token = decode["disk_bytes"] / n
    memory_per_token = dense_bytes_per_token(model) + decode["requested_bytes"] / n
    return {
        "mode": mode, "dense_bits": model.dense_bits,
        "kv_dtype": str(model.kv_dtype).removeprefix("torch."),
        "ram_bytes": store.ram_capacity if mode != "all-in-ram" else store.manifest.expert_bytes,
        "ram_grown_after_tokens": (store.ram_breakdown or {}).get("grown", {}).get("after_tokens"),
        "prefill_tokens": len(prompt), "ttft_s": ttft, "decode_tok_s": n / seconds,
        "hit_rate": decode["hits"] / decode["requests"] if decode["requests"] else 1.0,
        "disk_bytes_per_token": disk_per_token, "limit_decode_tok_s": limit_tok_s(disk_per_token, memory_per_token, bw),
        "memory_bytes_per_token": memory_per_token, "load_s": load_s,
        "prefill_disk_reads": prefill["disk_reads"], "prefill_expert_requests": prefill["requests"],
        "prefill_max_reads_per_chunk": max(chunk_reads),
        "decode_attention_s_per_token": decode["attention"] / n, "decode_experts_s_per_token": decode["experts"] / n,
        "decode_layers_s_per_token": decode["layers"] / n,
        "decode_io_wait_s_per_token": decode["io_wait"] / n,
        "decode_preloads_per_token": decode["preloads_loaded"] / n,
        "decode_preloads_used_per_token": decode["preloads_used"] / n,
        "decode_skipped_per_token": decode["skipped"] / n, "decode_fallback_uses_per_token": decode["fallback_uses"] / n,
        "decode_disk_reads_per_token": decode["disk_reads"] / n,
        "decode_read_cpu_s_per_token": decode["read_cpu"] / n, "decode_loader_cpu_s_per_token": decode["loader_cpu"] / n,
        "skip_below": config.skip_below if mode == "predictive" else 0.0,
        "fallback_below": config.fallback_below if mode == "predictive" else 0.0,
        "memory_bandwidth": bw.memory, "disk_bandwidth": bw.disk,
    }


def _decode_step(model, store, cache, last_position: int):
    """One greedy decode step: token -> the next. A store sized by --ram auto looks again once its
    tier is full, as `edgemoe run` does (edgemoe.ram_growth), so that the bench measures the product."""
    from .ram_growth import RamGrowth

    growth, decoded = RamGrowth.for_store(store), 0

    def step(token: int) -> int:
        nonlocal decoded
        token = int(model.logits([token], cache)[-1].argmax())
        decoded += 1
        if growth is not None:
            growth.after_step(decoded, cache, last_position)
        return token
    return step


# ---- the harness ------------------------------------------------------------------------------------

def prompt_tokens(vocab_size: int, length: int, seed: int) -> list[int]:
    """A fixed pseudo-random prompt (the bench measures speed: token identity only drives routing,
    which replay overrides)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def generated_routing(spec, tokens: int, model_seed: int = 0):
    """Mixtral-like routing for the model's shape (edgemoe.scheduling.synthetic_routing): a replay of one
    generated text of `tokens` tokens, and the routing profile of another text through the same
    generated model (what convert --calib profiles for a real model). Returns (replay, profile)."""
    from edgemoe.scheduling.profile import RoutingProfile
    from edgemoe.scheduling.synthetic_routing import generate
    from .replay import RoutingReplay, records_for_model

    layers, shape = spec.moe_layer_ids, (len(spec.moe_layer_ids), spec.num_experts, spec.top_k)
    replayed, _ = generate(*shape, sequences=1, tokens=tokens, seed=0, model_seed=model_seed)
    profiled, _ = generate(*shape, sequences=8, tokens=256, seed=1, model_seed=model_seed)
    profile = RoutingProfile.from_trace(records_for_model(profiled, layers), moe_layers=layers,
                                        num_experts=spec.num_experts, top_k=spec.top_k)
    return RoutingReplay(replayed, layers, spec.num_experts, spec.top_k, "generated routing"), profile


def default_prefill(context: int, decode_steps: int) -> tuple[int, ...]:
    """The default prompt lengths, 512 and 2048 tokens, those that leave room in the model's context
    for the decode steps; for a shorter context, the longest power of two that does."""
    room = context - decode_steps
    fitting = tuple(n for n in (512, 2048) if n <= room)
    return fitting or (1 << max(0, room.bit_length() - 1),)


def check_store(store_path: Path, config: BenchConfig) -> None:
    from edgemoe.store import read_manifest
    from edgemoe.store.profile_file import find_routing_profile

    manifest = read_manifest(store_path)
    if config.fallback_below and "predictive" in config.modes and not manifest.fallback:
        raise ValueError(f"--fallback-below {config.fallback_below}: {store_path} has no fallback copies "
                         f"(convert it with --fallback-bits)")
    context = manifest.spec.max_position_embeddings
    steps = config.warmup_tokens + config.decode_tokens
    for length in config.prefill_tokens:
        if length + steps > context:
            raise ValueError(f"--prefill {length}: with {steps} decode steps (--warmup-tokens + --decode-tokens) "
                             f"it exceeds the model's context of {context} tokens")

    if "predictive" in config.modes and config.routing_profile is None and find_routing_profile(store_path) is None:
        raise ValueError(f"{store_path}: mode 'predictive' preloads from the store's routing profile and this store "
                         "has none: run `edgemoe profile STORE --text FILE` (or --trace TRACE) first")


def warm_up(store_path: Path, config: BenchConfig) -> None:
    """Compile the kernels and calibrate the latency model outside the timings: a short run that
    takes both the few-token and the many-token expert paths."""
    model = open_model(store_path, "on-demand-lru", config)
    try:
        vocab = model.spec.vocab_size
        cache = model.new_cache()
        length = min(64, model.context_length - 1)
        token = int(model.logits(prompt_tokens(vocab, length, config.seed), cache)[-1].argmax())
        model.logits([token], cache)
    finally:
        model.close()


def median_record(runs: list[dict], bw: Bandwidths) -> dict:
    """Medians over the runs; the limit is that of the median bytes (preloads make them vary)."""
    record = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and key not in ("ram_bytes", "prefill_tokens", "memory_bandwidth",
                                                           "disk_bandwidth"):
            record[key] = statistics.median(r[key] for r in runs)
    record["limit_decode_tok_s"] = limit_tok_s(record["disk_bytes_per_token"], record["memory_bytes_per_token"], bw)
    record["repeats"] = len(runs)
    return record


def bench(store_path: str | os.PathLike, config: BenchConfig, on_run: Callable[[dict], None] | None = None,
          bandwidths: Bandwidths | None = None) -> tuple[list[dict], Bandwidths]:
    """Records (medians over repeats) for every mode and prompt length, and the bandwidths they are
    held against (measured now unless given)."""
    from edgemoe.store import read_manifest

    store_path = Path(store_path)
    check_store(store_path, config)
    vocab = read_manifest(store_path).spec.vocab_size
    warm_up(store_path, config)
    bw = bandwidths or measure_bandwidths(store_path)
    records = []
    for length in config.prefill_tokens:
        prompt = prompt_tokens(vocab, length, config.seed)
        runs: dict[str, list[dict]] = {mode: [] for mode in config.modes}
        for _ in range(config.repeats):   # modes interleaved, so that drift in the machine hits all alike
            for mode in config.modes:
                runs[mode].append(run_once(store_path, mode, prompt, config, bw))
                if on_run is not None:
                    on_run(runs[mode][-1])
        records += [median_record(runs[mode], bw) for mode in config.modes]
    return records, bw
