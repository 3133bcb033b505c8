"""Replay a routing trace against an expert cache: hit rates of eviction policies, with and without
EdgeMoE's correlation preload, and Belady's optimal eviction as the ceiling.

    python tools/simulate_cache.py TRACE.jsonl --cache-experts N [N ...] [--profile-from OTHER.jsonl]
                                   [--preload-k K] [--min-count C] [--min-probability P]
                                   [--policy NAME ...] [--tokens T] [--json] [--stats]

--stats prints the trace's routing statistics first (edgemoe.store.routing_stats: stay probability,
popularity skew, next-layer predictability, second-expert weights), to compare a generated trace
(tools/make_routing_trace.py) with a recorded one.

Model of the cache: N experts of equal size, starting empty, held in TieredStore's own tier class
(store/tiers.py _Tier, a budget of N experts of size 1). Each token walks its MoE layers in order;
each of a layer's experts is a request: a hit if resident, else a miss, and the expert is inserted,
evicting by the policy while the cache is full. The policies are edgemoe.store.policies' classes
driven as TieredStore drives them: set_layer(layer, the layer's experts) before each layer, touch on
every request (a miss is inserted, then touched), insert on insertion, remove on eviction,
victim(resident) to choose. They get the profile (its popularity as prior; "expected-use" its
predictions too), as the store passes profile.json's.

Preload "correlation": before a layer's requests, the profile predicts that layer's experts from the
token's earlier layers; those of the K most probable with P >= P_min (--min-probability, default the
runtime's, edgemoe.preload.MIN_PROBABILITY) that are not resident and that the tier admits
(_Tier.admit: the policy's admission rule, as the runtime's Preloader asks) are inserted, never
evicting the running layer's experts nor each other. Preload precision = preloads requested by that
token at that layer / preloads.

Cost: every miss and every preload is a disk read; reads per token = (misses + preloads) / tokens,
what a disk-bound decode pays. No scheme can read less than Belady's misses.

The profile comes from --profile-from, else from the first half of the trace's tokens, and every
policy is then scored on the second half (--tokens T: only its first T tokens). Belady evicts the
resident expert requested furthest in the future (no preload).

Output: a table, or with --json a list of {"policy", "preload", "cache_experts", "hit_rate",
"preload_precision", "reads_per_token", "preloads_per_token", "requests", "hits", "preloads",
"evictions"} (preload_precision null without preload).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from typing import NamedTuple

from edgemoe.preload import MIN_PROBABILITY
from edgemoe.store.policies import POLICIES, make_policy
from edgemoe.store.guard import GUARD_WINDOW_TOKENS, GuardedPolicy, SchemeGuard
from edgemoe.store.profile import RoutingProfile, read_trace, tokens_from_trace
from edgemoe.store.routing_stats import routing_statistics
from edgemoe.store.tiers import TierStats, _Tier

Key = tuple[int, int]          # (layer, expert)
POLICY_NAMES = ("lru", "lfu", "edgemoe", "expected-use")


def simulate(tokens, cache_experts: int, policy: str, preload_profile: RoutingProfile | None = None,
             preload_k: int | None = None, prior: RoutingProfile | None = None,
             min_probability: float = MIN_PROBABILITY, guard: bool = False) -> dict:
    """Replay tokens (list of {layer: experts}) through a cache of cache_experts experts.
    policy: a name in POLICIES or "belady"; preload_profile enables correlation preload (of
    predictions with P >= min_probability); prior: the routing profile the policy gets (its
    popularity, and its predictions for "expected-use"; default preload_profile), as the store
    passes profile.json's. guard: the store's SchemeGuard against a ghost LRU (edgemoe.store.guard)."""
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
    """What the simulated tier holds: experts of equal size, so the byte budget counts experts."""
    key: Key
    nbytes: int = 1


class _Cache:
    """TieredStore's tier code (_Tier) with its protection rule (TieredStore._protected): placing an
    expert never evicts the running layer's experts nor an unused preload of its own layer."""

    def __init__(self, capacity: int, policy):
        self.tier = _Tier("simulated", capacity, policy, TierStats())
        self.unused: set[Key] = set()     # preloaded, not yet requested (TieredStore._preloaded)

    def _protected(self, layer: int, running: set[Key]) -> set[Key]:
        self.unused &= self.tier.items.keys()    # an evicted preload is no longer protected
        return running | {k for k in self.unused if k[0] == layer}

    def request(self, key: Key, running: set[Key]) -> bool:
        """Serve a request; True on a hit. A miss is inserted (unless only protected experts could
        make room: then it is served uncached), then touched, as TieredStore.get does."""
        if key in self.tier.items:
            self.unused.discard(key)
            self.tier.policy.touch(key)
            return True
        if self.tier.put(_Expert(key), self._protected(key[0], running) - {key})[0]:
            self.tier.policy.touch(key)
        return False

    def preload(self, layer: int, wanted, running: set[Key]) -> list[Key]:
        """Insert the admitted ones of `wanted` ((key, probability), most wanted first, of `layer`)."""
        candidates = [(key, 1, p) for key, p in wanted if key not in self.tier.items]
        loaded = self.tier.admit(candidates, self._protected(layer, running))
        for key in loaded:
            self.tier.put(_Expert(key), self._protected(layer, running))
            self.unused.add(key)
        return loaded


def _replay(tokens, capacity: int, name: str, profile: RoutingProfile | None, preload_k: int | None,
            prior: RoutingProfile | None, min_probability: float, guarded: bool = False) -> dict:
    layers = sorted({l for routing in tokens for l in routing})
    if profile is not None and not set(layers) <= set(profile.moe_layers):
        raise ValueError(f"the profile's MoE layers {profile.moe_layers} do not cover the trace's {layers}")
    k = preload_k if preload_k is not None else (profile.top_k if profile else 0)
    popularity = ({(l, e): p for l, row in prior.popularity.items() for e, p in enumerate(row)}
                  if prior else None)
    # EdgeMoE's layer distance wraps at num_layers: the model's layer count, at least 1 + the last MoE layer.
    policy = make_policy(name, max(layers, default=0) + 1, popularity, prior)
    guard = SchemeGuard(capacity, window_layers=GUARD_WINDOW_TOKENS * len(layers)) if guarded else None
    if guard:
        policy = GuardedPolicy(policy, guard)
    cache = _Cache(capacity, policy)
    hits = total = preloads = preload_hits = 0
    pending: set[Key] = set()     # preloaded for the next layer, not yet scored
    for routing in tokens:
        history: dict[int, tuple[int, ...]] = {}
        order = sorted(routing)
        for i, layer in enumerate(order):
            needed = {(layer, e) for e in routing[layer]}
            if guard:   # as TieredStore.begin_layer: reads so far = misses + preloads
                guard.observe_layer(((key, 1) for key in sorted(needed)), total - hits + preloads)
            policy.set_layer(layer, needed)
            preload_hits += len(pending & needed)
            pending = set()
            history[layer] = tuple(routing[layer])
            if profile and i + 1 < len(order) and (guard is None or guard.allow_preload):
                # As the runtime: the next layer's predictions are placed while this layer runs,
                # never evicting this layer's experts.
                nxt = order[i + 1]
                wanted = [((nxt, e), p) for e, p in profile.predict(nxt, history)[:k] if p >= min_probability]
                pending = set(cache.preload(nxt, wanted, needed))
                preloads += len(pending)
            for e in sorted(routing[layer]):   # the runtime runs a layer's experts in ascending order
                total += 1
                hits += cache.request((layer, e), needed)
    return _result(hits, total, len(tokens), preloads, preload_hits, cache.tier.stats.evictions,
                   preload=profile is not None)


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
        results.append(simulate(trace_tokens, n, "belady"))
    return results


def _table(results: list[dict], note: str) -> str:
    lines = [note, f"{'cache':>6} {'policy':<12} {'preload':<12} {'guard':<5} {'reads/token':>11} {'hit rate':>8} "
                   f"{'preloads/token':>14} {'preload prec.':>13}"]
    for r in results:
        precision = "-" if r["preload_precision"] is None else f"{r['preload_precision']:.3f}"
        guarded = "yes" if r.get("guard") else "no"
        lines.append(f"{r['cache_experts']:>6} {r['policy']:<12} {r['preload']:<12} {guarded:<5} {r['reads_per_token']:>11.1f} "
                     f"{r['hit_rate']:>8.3f} {r['preloads_per_token']:>14.1f} {precision:>13}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="JSON-lines routing trace (docs/trace-format.md)")
    ap.add_argument("--cache-experts", type=int, nargs="+", required=True, help="cache size(s), in experts")
    ap.add_argument("--profile-from", help="trace to build the profile from (default: first half of TRACE)")
    ap.add_argument("--preload-k", type=int, help="experts preloaded per layer (default: the trace's top-k)")
    ap.add_argument("--min-count", type=int, default=3, help="profile back-off threshold (default 3)")
    ap.add_argument("--min-probability", type=float, default=MIN_PROBABILITY,
                    help=f"preload only predictions at least this probable (default {MIN_PROBABILITY}, the runtime's)")
    ap.add_argument("--policy", nargs="+", choices=POLICY_NAMES, default=list(POLICY_NAMES),
                    help="eviction policies to compare (default: all; Belady is always shown)")
    ap.add_argument("--tokens", type=int, help="score only the first N tokens (fast iteration)")
    ap.add_argument("--stats", action="store_true", help="print the trace's routing statistics first")
    ap.add_argument("--guard", action="store_true", help="also run each scheme with the store's guard against "
                    "a ghost on-demand LRU cache (edgemoe.store.guard)")
    ap.add_argument("--json", action="store_true", help="print a JSON list of records instead of a table")
    args = ap.parse_args(argv)
    try:
        results, note = _run_cli(args)
    except (OSError, ValueError) as exc:    # unreadable or malformed trace, bad option: one line, no traceback
        raise SystemExit(f"simulate_cache: {exc}") from None
    if args.stats:
        stats = routing_statistics(read_trace(args.trace))
        print(json.dumps(stats.to_dict()) if args.json else "\n".join(stats.lines()))
    print(json.dumps(results, indent=1) if args.json else _table(results, note))
    return 0


def _read_nonempty(path) -> list:
    records = read_trace(path)
    if not records:
        raise ValueError(f"{path}: the trace is empty")
    return records


def _run_cli(args) -> tuple[list[dict], str]:
    records = _read_nonempty(args.trace)
    tokens = tokens_from_trace(records)
    if args.profile_from:
        other = _read_nonempty(args.profile_from)
        profile = _profile(other, records, args.min_count)
        note = f"profile: {args.profile_from}; scored: all {len(tokens)} tokens of {args.trace}"
    else:
        if len(tokens) < 2:
            raise ValueError(f"{args.trace}: {len(tokens)} token: need 2 or more to split into profile and test halves")
        half = len(tokens) // 2
        first = _token_ids(records, half)
        profile = _profile([r for r in records if (r.seq, r.token) in first], records, args.min_count)
        note = f"profile: first {half} tokens of {args.trace}; scored: last {len(tokens) - half} tokens"
        tokens = tokens[half:]
    if args.tokens is not None:
        if args.tokens < 1:
            raise ValueError(f"--tokens {args.tokens}: expected >= 1")
        tokens = tokens[:args.tokens]
        note += f" (the first {len(tokens)} of them)"
    return run(tokens, profile, args.cache_experts, args.preload_k, args.policy, args.min_probability,
               args.guard), note


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


if __name__ == "__main__":
    sys.exit(main())
