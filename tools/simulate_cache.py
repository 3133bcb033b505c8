"""Replay a routing trace against an expert cache: hit rates of eviction policies, with and without
EdgeMoE's correlation preload, and Belady's optimal eviction as the ceiling.

    python tools/simulate_cache.py TRACE.jsonl --cache-experts N [N ...] [--profile-from OTHER.jsonl]
                                   [--preload-k K] [--min-count C] [--model-layers L] [--json]

--model-layers L lays the traces over L MoE layers as `edgemoe run --replay` does on a deeper model
(edgemoe.replay.records_for_model), so that the simulation sees the routing a replayed run sees.

Model of the cache: N experts of equal size, starting empty. Each token walks its MoE layers in
order; each of a layer's experts is a request: a hit if resident, else a miss, and the expert is
inserted, evicting by the policy while the cache is full. The policies are edgemoe.store.policies'
classes driven as TieredStore drives them: set_layer before each layer, touch on every request (a
miss is inserted, then touched), insert on insertion, remove on eviction, victim(resident) to choose.
Their popularity prior is the profile's, as the store passes profile.json's.

Preload "correlation": before a layer's requests, the profile predicts that layer's experts from the
token's earlier layers; those of the K most probable that are not resident are inserted (evicting
by the policy, never an expert just preloaded for this layer). Preload precision = preloads requested by
that token at that layer / preloads.

The profile comes from --profile-from, else from the first half of the trace's tokens, and every
policy is then scored on the second half. Belady evicts the resident expert requested furthest in
the future (no preload).

Output: a table, or with --json a list of {"policy", "preload", "cache_experts", "hit_rate",
"preload_precision", "requests", "hits", "preloads", "evictions"} (preload_precision null without preload).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys

from edgemoe.replay import records_for_model
from edgemoe.store.policies import POLICIES, make_policy
from edgemoe.store.profile import RoutingProfile, read_trace, tokens_from_trace

Key = tuple[int, int]          # (layer, expert)
POLICY_NAMES = ("lru", "lfu", "edgemoe")


def simulate(tokens, cache_experts: int, policy: str, preload_profile: RoutingProfile | None = None,
             preload_k: int | None = None, prior: RoutingProfile | None = None) -> dict:
    """Replay tokens (list of {layer: experts}) through a cache of cache_experts experts.
    policy: "lru", "lfu", "edgemoe" or "belady"; preload_profile enables correlation preload;
    prior: the profile whose popularity the policy gets (default preload_profile), as the store
    passes profile.json's."""
    if cache_experts < 1:
        raise ValueError(f"--cache-experts {cache_experts}: expected >= 1")
    if preload_k is not None and preload_k < 1:
        raise ValueError(f"--preload-k {preload_k}: expected >= 1")
    if policy == "belady":
        if preload_profile is not None:
            raise ValueError("policy 'belady' is the no-preload ceiling: give no preload_profile")
        result = _belady(tokens, cache_experts)
    elif policy in POLICIES:
        result = _replay(tokens, cache_experts, policy, preload_profile, preload_k, prior or preload_profile)
    else:
        raise ValueError(f"policy={policy!r}: expected one of {sorted(POLICIES) + ['belady']}")
    return {"policy": policy, "preload": "correlation" if preload_profile else "none",
            "cache_experts": cache_experts, **result}


def _result(hits: int, total: int, preloads: int = 0, preload_hits: int = 0, evictions: int = 0,
            preload: bool = False) -> dict:
    return {"hit_rate": hits / total if total else 0.0,
            "preload_precision": (preload_hits / preloads if preloads else 0.0) if preload else None,
            "requests": total, "hits": hits, "preloads": preloads, "evictions": evictions}


class _Cache:
    """A set of resident experts kept in step with a policy object, exactly as TieredStore's _Tier does."""

    def __init__(self, capacity: int, policy):
        self.capacity, self.policy = capacity, policy
        self.resident: set[Key] = set()
        self.evictions = 0

    def insert(self, key: Key, keep: set[Key] = frozenset()) -> bool:
        """Insert, evicting by policy among residents not in `keep`; False if nothing may go."""
        while len(self.resident) >= self.capacity:
            candidates = self.resident - keep
            if not candidates:
                return False
            victim = self.policy.victim(candidates)
            self.resident.remove(victim)
            self.policy.remove(victim)
            self.evictions += 1
        self.resident.add(key)
        self.policy.insert(key)
        return True


def _replay(tokens, capacity: int, name: str, profile: RoutingProfile | None, preload_k: int | None,
            prior: RoutingProfile | None) -> dict:
    layers = sorted({l for routing in tokens for l in routing})
    if profile is not None and not set(layers) <= set(profile.moe_layers):
        raise ValueError(f"the profile's MoE layers {profile.moe_layers} do not cover the trace's {layers}")
    k = preload_k if preload_k is not None else (profile.top_k if profile else 0)
    popularity = ({(l, e): p for l, row in prior.popularity.items() for e, p in enumerate(row)}
                  if prior else None)
    # EdgeMoE's layer distance wraps at num_layers: the model's layer count, at least 1 + the last MoE layer.
    cache = _Cache(capacity, make_policy(name, max(layers, default=0) + 1, popularity))
    hits = total = preloads = preload_hits = 0
    pending: set[Key] = set()     # preloaded for the next layer, not yet scored
    for routing in tokens:
        history: dict[int, tuple[int, ...]] = {}
        order = sorted(routing)
        for i, layer in enumerate(order):
            cache.policy.set_layer(layer)
            needed = {(layer, e) for e in routing[layer]}
            preload_hits += len(pending & needed)
            pending = set()
            history[layer] = tuple(routing[layer])
            if profile and i + 1 < len(order):
                # As the runtime: the next layer's predictions are placed while this layer runs,
                # never evicting this layer's experts.
                pending = _preload(cache, profile, order[i + 1], history, k, needed)
                preloads += len(pending)
            for e in sorted(routing[layer]):   # the runtime runs a layer's experts in ascending order
                key = (layer, e)
                total += 1
                if key in cache.resident:
                    hits += 1
                elif not cache.insert(key, keep=needed - {key}):
                    continue           # no room beside the running layer's experts: served uncached
                cache.policy.touch(key)
    return _result(hits, total, preloads, preload_hits, cache.evictions, preload=profile is not None)


def _preload(cache: _Cache, profile: RoutingProfile, layer: int, history, k: int, running: set[Key]) -> set[Key]:
    """Insert those of the k most probable experts of `layer` that are not resident, evicting neither
    the running layer's experts nor each other; returns them."""
    loaded: set[Key] = set()
    for e, _ in profile.predict(layer, history)[:k]:
        key = (layer, e)
        if key in cache.resident:
            continue
        if not cache.insert(key, keep=loaded | running):
            break   # the cache holds only this layer's preloads: no room for more
        loaded.add(key)
    return loaded


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
    return _result(hits, len(keys), evictions=evictions)


def run(trace_tokens, profile: RoutingProfile, cache_sizes, preload_k: int | None) -> list[dict]:
    results = []
    for n in cache_sizes:
        for name in POLICY_NAMES:
            for preload in (None, profile):
                results.append(simulate(trace_tokens, n, name, preload, preload_k, prior=profile))
        results.append(simulate(trace_tokens, n, "belady"))
    return results


def _table(results: list[dict], note: str) -> str:
    lines = [note, f"{'cache':>6} {'policy':<8} {'preload':<12} {'hit rate':>8} {'preload prec.':>13} {'preloads':>9}"]
    for r in results:
        precision = "-" if r["preload_precision"] is None else f"{r['preload_precision']:.3f}"
        lines.append(f"{r['cache_experts']:>6} {r['policy']:<8} {r['preload']:<12} {r['hit_rate']:>8.3f} "
                     f"{precision:>13} {r['preloads']:>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="JSON-lines routing trace (docs/trace-format.md)")
    ap.add_argument("--cache-experts", type=int, nargs="+", required=True, help="cache size(s), in experts")
    ap.add_argument("--profile-from", help="trace to build the profile from (default: first half of TRACE)")
    ap.add_argument("--preload-k", type=int, help="experts preloaded per layer (default: the trace's top-k)")
    ap.add_argument("--min-count", type=int, default=3, help="profile back-off threshold (default 3)")
    ap.add_argument("--model-layers", type=int, help="replay the traces over this many MoE layers (a deeper model)")
    ap.add_argument("--json", action="store_true", help="print a JSON list of records instead of a table")
    args = ap.parse_args(argv)
    try:
        results, note = _run_cli(args)
    except (OSError, ValueError) as exc:    # unreadable or malformed trace, bad option: one line, no traceback
        raise SystemExit(f"simulate_cache: {exc}") from None
    print(json.dumps(results, indent=1) if args.json else _table(results, note))
    return 0


def _read_nonempty(path, model_layers: int | None) -> list:
    records = read_trace(path)
    if not records:
        raise ValueError(f"{path}: the trace is empty")
    if model_layers is not None:
        if model_layers < 1:
            raise ValueError(f"--model-layers {model_layers}: must be at least 1")
        records = records_for_model(records, list(range(model_layers)))
    return records


def _run_cli(args) -> tuple[list[dict], str]:
    records = _read_nonempty(args.trace, args.model_layers)
    tokens = tokens_from_trace(records)
    if args.profile_from:
        other = _read_nonempty(args.profile_from, args.model_layers)
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
    return run(tokens, profile, args.cache_experts, args.preload_k), note


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
