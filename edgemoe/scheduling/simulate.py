"""Replay a routing trace against an expert cache: reads per token and hit rates of eviction
policies, with and without EdgeMoE's correlation preload, and Belady's optimal eviction as the ceiling.

    edgemoe simulate TRACE.jsonl --cache-experts N [N ...] [--profile-from OTHER.jsonl] [--preload-k K]
                     [--min-count C] [--min-probability P] [--policy NAME ...] [--tokens T] [--guard]
                     [--stats] [--json]

--stats prints the trace's routing statistics first (edgemoe.scheduling.routing_stats: stay
probability, popularity skew, next-layer predictability, second-expert weights), to compare a
generated trace (tools/make_routing_trace.py) with a recorded one.

Model of the cache: N experts of equal size, starting empty, held in the runtime store's own
ExpertCache (edgemoe.scheduling.cache: one tier of N experts of size 1, the store's protection and
admission rules, and with --guard its SchemeGuard). Each token walks its MoE layers in order: the
cache is told the layer and its experts (begin_layer), then each of the layer's experts is a
request: a hit if resident, else a miss, and the expert is placed, evicting by the policy. The
policies get the profile (its popularity as prior; "expected-use" its predictions too), as the
store passes profile.json's.

Preload "correlation": before a layer's requests, the profile predicts the next layer's experts from
the token's earlier layers; those of the K most probable with P >= P_min (--min-probability, default
the runtime's, edgemoe.scheduling.preload.MIN_PROBABILITY) that are not resident and that the cache
admits (ExpertCache.admit, as the runtime's Preloader asks) are placed. Preload precision = preloads
requested by that token at that layer / preloads.

Cost: every miss and every preload is a disk read; reads per token = (misses + preloads) / tokens,
what a disk-bound decode pays. No scheme can read less than Belady's misses.

The profile comes from --profile-from, else from the first half of the trace's tokens, and every
policy is then scored on the second half (--tokens T: only its first T tokens). Belady evicts the
resident expert requested furthest in the future (no preload).

Output: a table, or with --json a list of {"policy", "preload", "guard", "default", "cache_experts",
"hit_rate", "preload_precision", "reads_per_token", "preloads_per_token", "requests", "hits",
"preloads", "evictions"} (preload_precision null without preload; "adaptive" records also have
"adaptive_changes": [[layer calls so far, candidate followed from then], ...] and "ghost_misses":
{candidate: misses of its ghost cache}, on the layers the ghosts see: AdaptivePolicy). "default" marks the scheme a
store runs unless told otherwise (DEFAULT_POLICY, correlation preload from its profile, the guard),
simulated at every cache size whatever --policy and --guard ask, so that any trace can be checked
against it; the table marks it with "*".
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from .cache import ExpertCache
from .guard import GUARD_WINDOW_TOKENS, GuardedPolicy, SchemeGuard
from .policies import DEFAULT_POLICY, POLICIES, AdaptivePolicy, RoutingShape, make_policy
from .preload import MIN_PROBABILITY
from .profile import RoutingProfile, read_trace, tokens_from_trace

Key = tuple[int, int]          # (layer, expert)
POLICY_NAMES = tuple(POLICIES)   # every eviction policy, in the order of their table


def simulate(tokens, cache_experts: int, policy: str, preload_profile: RoutingProfile | None = None,
             preload_k: int | None = None, prior: RoutingProfile | None = None,
             min_probability: float = MIN_PROBABILITY, guard: bool = False) -> dict:
    """Replay tokens (list of {layer: experts}) through a cache of cache_experts experts.
    policy: a name in POLICIES or "belady"; preload_profile enables correlation preload (of
    predictions with P >= min_probability); prior: the routing profile the policy gets (its
    popularity, and its predictions for "expected-use"; default preload_profile), as the store
    passes profile.json's. guard: the store's SchemeGuard against a ghost LRU (edgemoe.scheduling.guard)."""
    if cache_experts < 1:
        raise ValueError(f"--cache-experts {cache_experts}: expected >= 1")
    if preload_k is not None and preload_k < 1:
        raise ValueError(f"--preload-k {preload_k}: expected >= 1")
    if not 0.0 <= min_probability <= 1.0:
        raise ValueError(f"--min-probability {min_probability}: expected 0..1")
    if policy == "belady":
        if preload_profile is not None:
            raise ValueError("policy 'belady' is the no-preload ceiling: give no preload_profile")
        result = _belady(tokens, cache_experts)
    elif policy in POLICIES:
        result = _replay(tokens, cache_experts, policy, preload_profile, preload_k, prior or preload_profile,
                         min_probability, guard)
    else:
        raise ValueError(f"policy={policy!r}: expected one of {sorted(POLICIES) + ['belady']}")
    return {"policy": policy, "preload": "correlation" if preload_profile else "none",
            "cache_experts": cache_experts, "guard": guard, **result}


def _result(hits: int, total: int, tokens: int, preloads: int = 0, preload_hits: int = 0, evictions: int = 0,
            preload: bool = False) -> dict:
    """Reads = misses + preloads: every one is a disk read, the cost a disk-bound decode pays."""
    reads = total - hits + preloads
    return {"hit_rate": hits / total if total else 0.0,
            "preload_precision": (preload_hits / preloads if preloads else 0.0) if preload else None,
            "reads_per_token": reads / tokens if tokens else 0.0,
            "preloads_per_token": preloads / tokens if tokens else 0.0,
            "requests": total, "hits": hits, "preloads": preloads, "evictions": evictions}


class _Expert(NamedTuple):
    """What the simulated cache holds: experts of equal size, so the byte capacity counts experts."""
    key: Key
    nbytes: int = 1


def _replay(tokens, capacity: int, name: str, profile: RoutingProfile | None, preload_k: int | None,
            prior: RoutingProfile | None, min_probability: float, guarded: bool = False) -> dict:
    layers = sorted({l for routing in tokens for l in routing})
    if profile is not None and not set(layers) <= set(profile.moe_layers):
        raise ValueError(f"the profile's MoE layers {profile.moe_layers} do not cover the trace's {layers}")
    k = preload_k if preload_k is not None else (profile.top_k if profile else 0)
    popularity = ({(l, e): p for l, row in prior.popularity.items() for e, p in enumerate(row)}
                  if prior else None)
    # EdgeMoE's layer distance wraps at num_layers: the model's layer count, at least 1 + the last MoE layer.
    num_layers = max(layers, default=0) + 1
    guard = SchemeGuard(capacity, window_layers=GUARD_WINDOW_TOKENS * len(layers)) if guarded else None
    # The model's shape as the store gives it to adaptive eviction where there is no profile: the trace's
    # MoE layers and its widest choice (none for no tokens).
    widest = max((len(experts) for routing in tokens for experts in routing.values()), default=0)
    shape = RoutingShape(layers, widest) if layers else None
    cache = ExpertCache([("cache", capacity)], lambda: make_policy(name, num_layers, popularity, prior, shape),
                        guard)
    hits = total = preloads = preload_hits = 0
    pending: set[Key] = set()     # preloaded for the next layer, not yet scored
    for routing in tokens:
        history: dict[int, tuple[int, ...]] = {}
        order = sorted(routing)
        for i, layer in enumerate(order):
            needed = {(layer, e): 1 for e in routing[layer]}
            cache.begin_layer(layer, needed, read_bytes=total - hits + preloads)   # reads so far
            preload_hits += len(pending & needed.keys())
            pending = set()
            history[layer] = tuple(routing[layer])
            if profile and i + 1 < len(order):
                # As the runtime: the next layer's predictions are placed while this layer runs,
                # never evicting this layer's experts.
                nxt = order[i + 1]
                wanted = [((nxt, e), 1, p) for e, p in profile.predict(nxt, history)[:k]
                          if p >= min_probability and cache.find((nxt, e)) is None]
                loaded = cache.admit(wanted)
                for key in loaded:
                    cache.place(_Expert(key), "preload")
                pending = set(loaded)
                preloads += len(loaded)
            for e in sorted(routing[layer]):   # the runtime runs a layer's experts in ascending order
                total += 1
                if cache.request((layer, e)) is not None:
                    hits += 1
                else:
                    cache.place(_Expert((layer, e)), "demand")
    result = _result(hits, total, len(tokens), preloads, preload_hits, cache.stats.tiers["cache"].evictions,
                     preload=profile is not None)
    policy = cache.tiers[0].policy
    if isinstance(policy, GuardedPolicy):
        policy = policy.primary
    if isinstance(policy, AdaptivePolicy):
        result["adaptive_changes"] = policy.changes
        result["ghost_misses"] = {name: ghost.misses for name, ghost in policy.ghosts.items()}
    return result


def _belady(tokens, capacity: int) -> dict:
    """Optimal eviction: on a miss with a full cache, drop the resident expert whose next request is
    furthest away (never requested again = infinitely far), from a max-heap of (next use, key)."""
    keys = [(layer, e) for routing in tokens for layer in sorted(routing) for e in sorted(routing[layer])]
    never = len(keys)
    next_use, later = [never] * len(keys), {}
    for i in range(len(keys) - 1, -1, -1):
        next_use[i] = later.get(keys[i], never)
        later[keys[i]] = i
    resident: dict[Key, int] = {}     # key -> index of its next request
    heap: list[tuple[int, Key]] = []  # (-next use, key)
    hits = evictions = 0
    for i, key in enumerate(keys):
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            # Stale entries (a resident's earlier next uses) hold past positions and live ones future
            # positions, so the top is always live.
            neg_next, victim = heapq.heappop(heap)
            assert resident[victim] == -neg_next
            del resident[victim]
            evictions += 1
        resident[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return _result(hits, len(keys), len(tokens), evictions=evictions)


def run(trace_tokens, profile: RoutingProfile, cache_sizes, preload_k: int | None, policies=POLICY_NAMES,
        min_probability: float = MIN_PROBABILITY, guard: bool = False) -> list[dict]:
    results = []
    for n in cache_sizes:
        for name in policies:
            for preload in (None, profile):
                for guarded in (False, True) if guard else (False,):
                    results.append(simulate(trace_tokens, n, name, preload, preload_k, profile, min_probability,
                                            guarded))
        if not (guard and DEFAULT_POLICY in policies):
            results.append(simulate(trace_tokens, n, DEFAULT_POLICY, profile, preload_k, profile, min_probability,
                                    guard=True))
        results.append(simulate(trace_tokens, n, "belady"))
    return [dict(r, default=is_default_scheme(r)) for r in results]


def is_default_scheme(record: dict) -> bool:
    """Whether a record is the scheme a store runs by default: DEFAULT_POLICY, correlation preload, the guard."""
    return (record["policy"], record["preload"], record["guard"]) == (DEFAULT_POLICY, "correlation", True)


def table(results: list[dict], note: str) -> str:
    lines = [note + " (* the store's default scheme)", f"{'cache':>6} {'policy':<12} {'preload':<12} {'guard':<5} {'reads/token':>11} {'hit rate':>8} "
                   f"{'preloads/token':>14} {'preload prec.':>13}"]
    for r in results:
        precision = "-" if r["preload_precision"] is None else f"{r['preload_precision']:.3f}"
        guarded = "yes" if r.get("guard") else "no"
        policy = r["policy"] + ("*" if r.get("default") else "")
        lines.append(f"{r['cache_experts']:>6} {policy:<12} {r['preload']:<12} {guarded:<5} {r['reads_per_token']:>11.1f} "
                     f"{r['hit_rate']:>8.3f} {r['preloads_per_token']:>14.1f} {precision:>13}")
    return "\n".join(lines)


def simulate_trace(trace, cache_sizes, profile_from=None, preload_k: int | None = None, min_count: int = 3,
                   min_probability: float = MIN_PROBABILITY, policies=POLICY_NAMES, tokens: int | None = None,
                   guard: bool = False) -> tuple[list[dict], str]:
    """`edgemoe simulate`: the records of `run` on a trace file, and a note saying which tokens
    built the profile and which were scored. ValueError (naming the file or option) for a trace
    that is empty or too short, or a bad option."""
    records = _read_nonempty(trace)
    scored = tokens_from_trace(records)
    if profile_from:
        profile = _profile(_read_nonempty(profile_from), records, min_count)
        note = f"profile: {profile_from}; scored: all {len(scored)} tokens of {trace}"
    else:
        if len(scored) < 2:
            raise ValueError(f"{trace}: {len(scored)} token: need 2 or more to split into profile and test halves")
        half = len(scored) // 2
        first = _token_ids(records, half)
        profile = _profile([r for r in records if (r.seq, r.token) in first], records, min_count)
        note = f"profile: first {half} tokens of {trace}; scored: last {len(scored) - half} tokens"
        scored = scored[half:]
    if tokens is not None:
        scored = scored[:tokens]
        note += f" (the first {len(scored)} of them)"
    return run(scored, profile, cache_sizes, preload_k, policies, min_probability, guard), note


def _read_nonempty(path) -> list:
    records = read_trace(path)
    if not records:
        raise ValueError(f"{path}: the trace is empty")
    return records


def _token_ids(records, n: int) -> set:
    """The first n (seq, token) pairs in order of first appearance (tokens_from_trace's order)."""
    ids = dict.fromkeys((r.seq, r.token) for r in records)
    return set(list(ids)[:n])


def _profile(profile_records, trace_records, min_count: int) -> RoutingProfile:
    """Sizes from both traces, so that a layer or expert absent from the profile's trace still fits."""
    both = list(profile_records) + list(trace_records)
    return RoutingProfile.from_trace(profile_records, moe_layers=sorted({r.layer for r in both}),
                                     num_experts=1 + max(max(r.experts) for r in both),
                                     top_k=max(len(r.experts) for r in both), min_count=min_count)
