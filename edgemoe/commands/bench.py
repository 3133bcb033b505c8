"""`edgemoe bench`: time to first token and decode speed of a store, next to the physical limit."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

import json

from rich.console import Console
from rich.table import Table

from edgemoe import options
from edgemoe.progress import progress_bar

from .common import replay_for, size
from .options import (COMPUTE, DENSE_BITS, DTYPE, FALLBACK_BELOW, JSON, KV_DTYPE, QUIET, SKIP_BELOW, THREADS,
                      as_store_options, checked, torch_dtype)


def _bench_mode(value, flag):
    from edgemoe.bench import MODES
    return options.one_of(value, flag, MODES)


def bench(
    store_path: Path = typer.Argument(..., metavar="STORE", help="Store directory."),
    ram: str = typer.Option("25%", "--ram", help="RAM for experts: bytes (e.g. 1GiB), a share of the store's "
                            "expert bytes (e.g. 25%), or auto (as edgemoe run sizes it, inside --memory-limit "
                            "when given)."),
    mode: List[str] = typer.Option([], "--mode", callback=checked(_bench_mode),
                                   help="all-in-ram, on-demand-lru or predictive (repeatable; default: all three)."),
    prefill: List[int] = typer.Option([], "--prefill", callback=checked(options.integer_at_least, 1),
                                      help="Prompt length in tokens (repeatable; default 512 and 2048, those that "
                                      "fit the model's context)."),
    decode_tokens: int = typer.Option(32, "--decode-tokens", callback=checked(options.integer_at_least, 1),
                                      help="Timed decode steps per run."),
    warmup_tokens: int = typer.Option(4, "--warmup-tokens", callback=checked(options.integer_at_least, 0),
                                      help="Decode steps before the timed ones."),
    repeats: int = typer.Option(3, "--repeats", callback=checked(options.integer_at_least, 1),
                                help="Runs per mode and prompt length (medians reported)."),
    cold: bool = typer.Option(False, "--cold", help="Drop the store's files from the page cache before each run."),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Route by this trace (a random-weight model "
                                          "routed as a real one was); the predictive mode uses the store's profile."),
    routing: str = typer.Option("generated", "--routing", callback=checked(options.one_of, ("generated", "model")),
                                help="Without --replay: generated (Mixtral-like routing for the model's shape, "
                                "and the profile of another generated text) or model (its own routers)."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", callback=checked(options.parse_bytes),
                                               help="Run inside a cgroup v1 memory limit of this size, page cache "
                                               "included (Linux, root)."),
    as_json: bool = JSON,
    compute: str = COMPUTE,
    skip_below: float = SKIP_BELOW,
    fallback_below: float = FALLBACK_BELOW,
    dtype: str = DTYPE,
    dense_bits: str = DENSE_BITS,
    kv_dtype: str = KV_DTYPE,
    threads: Optional[int] = THREADS,
    quiet: bool = QUIET,
):
    """Time to first token and decode speed with a RAM capacity, per mode, next to the physical limit.

    --skip-below and --fallback-below act in the predictive mode only (the others trade no quality)."""
    from edgemoe.bench import (MODES, BenchConfig, bench as run_bench, confine_memory, default_prefill,
                               generated_routing, leave_memory_group, machine_summary, measure_bandwidths, parse_ram)
    from edgemoe.loader import require_decoder_only
    from edgemoe.store import read_manifest

    # The store's flags bench takes (its modes set the others), checked as every command checks them.
    store_options = as_store_options(compute=compute, skip_below=skip_below, fallback_below=fallback_below)
    spec = read_manifest(store_path).spec
    require_decoder_only(spec, store_path, "edgemoe bench")
    steps = warmup_tokens + decode_tokens
    lengths = tuple(prefill) or default_prefill(spec.max_position_embeddings, steps)
    profile = None
    if replay is not None:
        routed_by, replayer = f"the trace {replay}", replay_for(spec, replay)
    elif routing == "generated":
        routed_by = "generated Mixtral-like routing (edgemoe.scheduling.synthetic_routing, model seed 0)"
        replayer, profile = generated_routing(spec, max(lengths) + steps)
    else:
        routed_by, replayer = "the model's own routers", None
    config = BenchConfig(ram=parse_ram(ram, store_path), modes=tuple(mode) or MODES, prefill_tokens=lengths,
                         decode_tokens=decode_tokens, warmup_tokens=warmup_tokens, repeats=repeats, cold=cold,
                         replay=replayer, dtype=torch_dtype(dtype), dense_bits=dense_bits, kv_dtype=kv_dtype,
                         threads=threads, routing_profile=profile, skip_below=store_options.skip_below,
                         fallback_below=store_options.fallback_below, compute=store_options.compute)
    # The bandwidths are measured first, outside the memory limit: their 1 GiB buffer is not the run's.
    bandwidths = measure_bandwidths(store_path)
    group = confine_memory(memory_limit) if memory_limit is not None else None
    runs = len(config.modes) * len(config.prefill_tokens) * config.repeats
    done = []
    try:
        with progress_bar("benchmark runs", quiet) as report:
            records, _ = run_bench(store_path, config, on_run=lambda record: (done.append(record),
                                                                         report(len(done), runs)),
                                   bandwidths=bandwidths)
    finally:
        usage = leave_memory_group(group) if group is not None else None
    peak_line = None if usage is None else (f"peak memory of the run, page cache included: {size(usage[0])}; "
                                            f"limit hit {usage[1]} times (memory.failcnt)")
    if as_json:
        print(json.dumps(records, indent=1))
        if peak_line:
            print(peak_line, file=sys.stderr)
        return
    print(machine_summary(bandwidths, memory_limit))
    print(f"routing: {routed_by}")
    if peak_line:
        print(peak_line)
    _print_bench_table(records)


def _print_bench_table(records: list) -> None:
    table = Table("mode", "RAM", "prompt", "TTFT s", "decode tok/s", "limit tok/s", "of limit", "hit rate",
                  "disk MiB/token")
    for r in records:
        table.add_row(r["mode"], size(r["ram_bytes"]), str(r["prefill_tokens"]), f"{r['ttft_s']:.2f}",
                      f"{r['decode_tok_s']:.2f}", f"{r['limit_decode_tok_s']:.2f}",
                      f"{r['decode_tok_s'] / r['limit_decode_tok_s']:.0%}", f"{r['hit_rate']:.3f}",
                      f"{r['disk_bytes_per_token'] / 2**20:.1f}")
    Console(width=max(120, Console().width)).print(table)
