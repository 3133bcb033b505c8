"""`edgemoe simulate`: replay a routing trace through the store's expert cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from edgemoe import options
from edgemoe.scheduling.policies import POLICIES
from edgemoe.scheduling.profile import read_trace
from edgemoe.scheduling.routing_stats import routing_statistics

from .options import JSON, checked


def _unit_interval(value: float, flag: str) -> float:
    if not 0 <= value <= 1:
        raise options.OptionError(flag, value, "expected a number in [0, 1]")
    return value


def _policy(value, flag):
    return options.one_of(value, flag, sorted(POLICIES))


def simulate(
    trace: Path = typer.Argument(..., help="JSON-lines routing trace (docs/trace-format.md)."),
    cache_experts: List[int] = typer.Option(..., "--cache-experts", callback=checked(options.integer_at_least, 1),
                                            help="Cache size in experts (repeatable)."),
    profile_from: Optional[Path] = typer.Option(None, "--profile-from", help="Trace to build the routing "
                                                "profile from (default: the first half of TRACE)."),
    preload_k: Optional[int] = typer.Option(None, "--preload-k", callback=checked(options.integer_at_least, 1),
                                            help="Experts preloaded per layer at most (default: the trace's top-k)."),
    min_count: int = typer.Option(3, "--min-count", callback=checked(options.integer_at_least, 1),
                                  help="Profile back-off: a history seen fewer times falls back to a coarser table."),
    min_probability: float = typer.Option(0.5, "--min-probability", callback=checked(_unit_interval),
                                          help="Preload only predictions at least this probable (the runtime's 0.5)."),
    policies: List[str] = typer.Option([], "--policy", callback=checked(_policy),
                                       help="Eviction policies to compare (repeatable; default all; Belady always)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", callback=checked(options.integer_at_least, 1),
                                         help="Score only the first N tokens."),
    guard: bool = typer.Option(False, "--guard", help="Also run each scheme with the store's guard against a "
                               "ghost on-demand LRU cache."),
    stats: bool = typer.Option(False, "--stats", help="Print the trace's routing statistics first."),
    as_json: bool = JSON,
):
    """Replay a routing trace through the store's expert cache: reads per token per policy and preload."""
    from edgemoe.scheduling.simulate import POLICY_NAMES, simulate_trace, table

    results, note = simulate_trace(trace, cache_experts, profile_from, preload_k, min_count, min_probability,
                                   tuple(policies) or POLICY_NAMES, tokens, guard)
    if stats:
        routing = routing_statistics(read_trace(trace))
        print(json.dumps(routing.to_dict()) if as_json else "\n".join(routing.lines()))
    print(json.dumps(results, indent=1) if as_json else table(results, note))
