"""Routing traces and the routing profile: EdgeMoE's offline statistics for preload and eviction.

Trace (docs/trace-format.md): JSON lines, one per (sequence, token, MoE layer), experts in the
router's top-k order:
    {"seq": 0, "token": 5, "layer": 1, "experts": [3, 0], "weights": [0.62, 0.38]}
A token's routing is {layer: experts} over the MoE layers, e.g. {0: (3, 0), 1: (1, 5), 3: (0, 2)}.

Profile, over MoE layers only ("previous layer" = previous MoE layer), E experts, top-k A:
    popularity[l][e]    fraction of layer l's token-slots that chose e (sums to 1 over e)
    given_prev[l][k1]   tokens seen with key k1 at l-1, and per expert e how many of them chose e at l
    given_prev2[l][k2]  the same for key k2 = "k1|k0" (experts at l-1 | experts at l-2)
A key is the sorted experts chosen at a layer, comma-joined: "1,5" (top-2), "1|0" (top-1, two layers).
Counts are kept, not probabilities, so profiles merge and back-off can judge how often a key was seen.

predict(l, history) gives P(e is among layer l's chosen experts), which sums to A over e, from the most
specific table whose key was seen at least min_count times: given_prev2, else given_prev, else
popularity (then P = A * popularity[l][e]).

Temporal statistics, over pairs of consecutive tokens (positions p and p+1 of one sequence):
    pairs[l]            how many pairs
    before[l][e]        pairs whose first token chose e at l; after[l][e]: whose second token did
    both[l][e]          pairs whose two tokens both chose e at l
reuse(l, e, used) gives P(e chosen at l by the next token | this token chose it (used) or not):
"stay" = both / before, "arrive" = (after - both) / (pairs - before), each from at least min_count
pairs, else A * popularity[l][e] (also for a profile saved without these counts).

A store keeps its routing profile in profile.json (edgemoe.store.profile_file).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from edgemoe.files import atomic_write

Routing = dict[int, tuple[int, ...]]   # one token: MoE layer -> experts (router's top-k order)
PROFILE_VERSION = 1


# ---- traces -----------------------------------------------------------------------------------------
@dataclass
class TraceRecord:
    seq: int | str
    token: int                 # position in the sequence
    layer: int
    experts: list[int]         # router's top-k order
    weights: list[float]       # routing weights, same order


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_record(obj) -> TraceRecord:
    """One decoded JSON line -> TraceRecord; ValueError saying which field is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    missing = [f for f in ("seq", "token", "layer", "experts", "weights") if f not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    seq, token, layer, experts, weights = (obj[f] for f in ("seq", "token", "layer", "experts", "weights"))
    if not (_is_int(seq) or isinstance(seq, str)):
        raise ValueError(f"seq={seq!r}: expected an int or a string")
    if not (_is_int(token) and token >= 0) or not (_is_int(layer) and layer >= 0):
        raise ValueError(f"token={token!r}, layer={layer!r}: expected non-negative ints")
    if not isinstance(experts, list) or not experts or not all(_is_int(e) and e >= 0 for e in experts):
        raise ValueError(f"experts={experts!r}: expected a non-empty list of non-negative ints")
    if len(set(experts)) != len(experts):
        raise ValueError(f"experts={experts!r}: an expert appears twice")
    if (not isinstance(weights, list) or len(weights) != len(experts)
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)):
        raise ValueError(f"weights={weights!r}: expected {len(experts)} numbers, one per expert")
    return TraceRecord(seq, token, layer, list(experts), [float(w) for w in weights])


def read_trace(path) -> list[TraceRecord]:
    """Read a JSON-lines trace; blank lines are skipped; ValueError naming file and line otherwise."""
    path = Path(path)
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(_parse_record(json.loads(line)))
                except (json.JSONDecodeError, ValueError) as exc:
                    raise ValueError(f"{path}:{lineno}: malformed trace record: {exc}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a trace (JSON lines of UTF-8 text; {e.reason} at byte {e.start})") from None
    return records


def write_trace(path, records) -> None:
    """Write a JSON-lines trace, atomically (edgemoe.files: an interrupted write keeps the old file)."""
    def write(f):
        for r in records:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")
    atomic_write(path, write)


def tokens_from_trace(records) -> list[Routing]:
    """Group records into per-token routing {layer: experts}, tokens in (seq, token) order of first
    appearance, layers ascending. A repeated (seq, token, layer) is an error."""
    tokens: dict[tuple, Routing] = {}
    for r in records:
        routing = tokens.setdefault((r.seq, r.token), {})
        if r.layer in routing:
            raise ValueError(f"trace: two records for seq={r.seq!r} token={r.token} layer={r.layer}")
        routing[r.layer] = tuple(r.experts)
    return [dict(sorted(routing.items())) for routing in tokens.values()]


def consecutive_tokens(records) -> list[tuple[Routing, Routing]]:
    """Pairs (token at position p, token at p+1) of the same sequence, as {layer: experts}."""
    tokens: dict[tuple, Routing] = {}
    for r in records:
        tokens.setdefault((r.seq, r.token), {})[r.layer] = tuple(r.experts)
    return [(routing, tokens[(seq, token + 1)]) for (seq, token), routing in tokens.items()
            if (seq, token + 1) in tokens]


# ---- the profile ------------------------------------------------------------------------------------
PROFILE_ANSWERS = 1024   # predictions remembered (RoutingProfile.predict)


def _key(experts) -> str:
    return ",".join(str(e) for e in sorted(experts))


class RoutingProfile:
    """Counts of a model's routing over MoE layers (see the module docstring); add_token to build,
    predict to query, save/load for STORE/profile.json."""

    def __init__(self, moe_layers: list[int], num_experts: int, top_k: int, min_count: int = 3):
        if not moe_layers or sorted(set(moe_layers)) != list(moe_layers):
            raise ValueError(f"moe_layers={moe_layers!r}: expected distinct layer ids in increasing order")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k}: expected 1..num_experts ({num_experts})")
        if min_count < 1:
            raise ValueError(f"min_count={min_count}: expected >= 1")
        self.moe_layers = list(moe_layers)
        self.num_experts, self.top_k, self.min_count = num_experts, top_k, min_count
        self.counts: dict[int, list[int]] = {l: [0] * num_experts for l in self.moe_layers}
        self.given_prev: dict[int, dict[str, tuple[int, Counter]]] = {l: {} for l in self.moe_layers}
        self.given_prev2: dict[int, dict[str, tuple[int, Counter]]] = {l: {} for l in self.moe_layers}
        self._previous = {l: self.moe_layers[:i][::-1][:2] for i, l in enumerate(self.moe_layers)}  # [l-1, l-2]
        self.pairs: dict[int, int] = {l: 0 for l in self.moe_layers}
        self.before: dict[int, list[int]] = {l: [0] * num_experts for l in self.moe_layers}
        self.after: dict[int, list[int]] = {l: [0] * num_experts for l in self.moe_layers}
        self.both: dict[int, list[int]] = {l: [0] * num_experts for l in self.moe_layers}
        # (layer, id of the counts predict read) -> its answer: in a decode the preloader and adaptive
        # eviction's expected-use ghost and follower ask the same question per layer, and every
        # history a layer's popularity answers for has the same answer
        self._answers: dict[tuple[int, int], tuple[tuple[int, float], ...]] = {}

    # ---- building ---------------------------------------------------------------------------------
    def add_token(self, routing: Routing) -> None:
        """Count one token's routing; layers missing from it are skipped (and keys needing them)."""
        self._answers.clear()
        for layer, experts in routing.items():
            self._check(layer, experts)
        for layer, experts in routing.items():
            for e in experts:
                self.counts[layer][e] += 1
            prev = [routing.get(p) for p in self._previous[layer]]
            if prev and prev[0] is not None:
                self._count(self.given_prev[layer], _key(prev[0]), experts)
                if len(prev) == 2 and prev[1] is not None:
                    self._count(self.given_prev2[layer], f"{_key(prev[0])}|{_key(prev[1])}", experts)

    def add_pair(self, first: Routing, second: Routing) -> None:
        """Count two consecutive tokens of one sequence (temporal statistics); layers missing from
        either are skipped."""
        self._answers.clear()
        for routing in (first, second):
            for layer, experts in routing.items():
                self._check(layer, experts)
        for layer in first.keys() & second.keys():
            self.pairs[layer] += 1
            for e in first[layer]:
                self.before[layer][e] += 1
            for e in second[layer]:
                self.after[layer][e] += 1
            for e in set(first[layer]) & set(second[layer]):
                self.both[layer][e] += 1

    def _check(self, layer: int, experts) -> None:
        if layer not in self.counts:
            raise ValueError(f"routing: layer {layer} is not a MoE layer of the profile ({self.moe_layers})")
        if len(experts) != self.top_k or len(set(experts)) != len(experts):
            raise ValueError(f"routing: layer {layer} experts {tuple(experts)}: expected {self.top_k} distinct")
        if not all(0 <= e < self.num_experts for e in experts):
            raise ValueError(f"routing: layer {layer} experts {tuple(experts)}: outside 0..{self.num_experts - 1}")

    @staticmethod
    def _count(table: dict[str, tuple[int, Counter]], key: str, experts) -> None:
        seen, counts = table.get(key, (0, Counter()))
        counts.update(experts)
        table[key] = (seen + 1, counts)

    @classmethod
    def from_trace(cls, records, moe_layers=None, num_experts=None, top_k=None, min_count: int = 3) -> "RoutingProfile":
        """Sizes not given are inferred from the trace: its layers, 1 + its largest expert id (an expert
        no token chose is then missed), its longest expert list."""
        records = list(records)
        if not records:
            raise ValueError("from_trace: the trace is empty")
        moe_layers = moe_layers if moe_layers is not None else sorted({r.layer for r in records})
        num_experts = num_experts if num_experts is not None else 1 + max(max(r.experts) for r in records)
        top_k = top_k if top_k is not None else max(len(r.experts) for r in records)
        profile = cls(moe_layers, num_experts, top_k, min_count)
        for routing in tokens_from_trace(records):
            profile.add_token(routing)
        for first, second in consecutive_tokens(records):
            profile.add_pair(first, second)
        return profile

    # ---- querying ---------------------------------------------------------------------------------
    @property
    def popularity(self) -> dict[int, list[float]]:
        return {l: [c / max(1, sum(row)) for c in row] for l, row in self.counts.items()}

    def reuse(self, layer: int, expert: int, used: bool) -> float:
        """P(expert is chosen at layer by the next token | this token chose it there (used) or not):
        "stay" or "arrive" (module docstring), backing off to A * popularity below min_count pairs."""
        before, both = self.before[layer][expert], self.both[layer][expert]
        if used:
            seen, chosen = before, both
        else:
            seen, chosen = self.pairs[layer] - before, self.after[layer][expert] - both
        if seen >= self.min_count:
            return chosen / seen
        row = self.counts[layer]
        return self.top_k * row[expert] / max(1, sum(row))

    def source(self, layer: int, history: Routing) -> str:
        """Which table predict uses: "l-1,l-2", "l-1" or "popularity" (the back-off order)."""
        return self._table(layer, history)[0]

    def _table(self, layer: int, history: Routing) -> tuple[str, int, Counter | list[int]]:
        if layer not in self.counts:
            raise ValueError(f"predict: layer {layer} is not a MoE layer of the profile ({self.moe_layers})")
        prev = [history.get(p) for p in self._previous[layer]]
        if len(prev) == 2 and None not in prev:
            seen, counts = self.given_prev2[layer].get(f"{_key(prev[0])}|{_key(prev[1])}", (0, None))
            if seen >= self.min_count:
                return "l-1,l-2", seen, counts
        if prev and prev[0] is not None:
            seen, counts = self.given_prev[layer].get(_key(prev[0]), (0, None))
            if seen >= self.min_count:
                return "l-1", seen, counts
        tokens = sum(self.counts[layer]) / self.top_k   # each token fills top_k slots
        return "popularity", tokens, self.counts[layer]

    def predict(self, layer: int, history: Routing) -> list[tuple[int, float]]:
        """All E experts as (expert, P(chosen at layer | history)), most probable first; ties go to
        the more popular expert, then the lower id. history: experts at earlier MoE layers. The
        answer is remembered per table row (at most PROFILE_ANSWERS, then all forgotten at once: an
        atomic clear, so that threads asking at once need no lock; counting more tokens forgets them)."""
        _, seen, counts = self._table(layer, history)
        key = (layer, id(counts))     # a row lives as long as the profile's tables, which add_* clear for
        answer = self._answers.get(key)
        if answer is None:
            popular = self.counts[layer]
            probs = [(e, counts[e] / seen if seen else 0.0) for e in range(self.num_experts)]
            answer = tuple(sorted(probs, key=lambda ep: (-ep[1], -popular[ep[0]], ep[0])))
            if len(self._answers) >= PROFILE_ANSWERS:
                self._answers.clear()
            self._answers[key] = answer
        return list(answer)

    # ---- serialisation ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        def table(t):
            return {str(l): {k: {"seen": seen, "counts": {str(e): c for e, c in sorted(counts.items())}}
                             for k, (seen, counts) in rows.items()} for l, rows in t.items()}
        return {"version": PROFILE_VERSION, "moe_layers": self.moe_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, "min_count": self.min_count,
                "counts": {str(l): row for l, row in self.counts.items()},
                "given_prev": table(self.given_prev), "given_prev2": table(self.given_prev2),
                "temporal": {str(l): {"pairs": self.pairs[l], "before": self.before[l], "after": self.after[l],
                                      "both": self.both[l]} for l in self.moe_layers}}

    @classmethod
    def from_json(cls, d: dict) -> "RoutingProfile":
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"routing profile version {d.get('version')!r}: expected {PROFILE_VERSION}")
        profile = cls(d["moe_layers"], d["num_experts"], d["top_k"], d["min_count"])
        counts = {int(l): [int(c) for c in row] for l, row in d["counts"].items()}
        if sorted(counts) != profile.moe_layers or any(len(row) != profile.num_experts for row in counts.values()):
            raise ValueError("routing profile: 'counts' needs one row of num_experts counts per MoE layer")
        profile.counts = counts
        profile.given_prev.update({int(l): _table_from_json(rows) for l, rows in d["given_prev"].items()})
        profile.given_prev2.update({int(l): _table_from_json(rows) for l, rows in d["given_prev2"].items()})
        if "temporal" in d:    # absent from profiles saved before it existed: reuse() falls back to popularity
            profile._temporal_from_json(d["temporal"])
        return profile

    def _temporal_from_json(self, temporal: dict) -> None:
        rows = {int(l): row for l, row in temporal.items()}
        if sorted(rows) != self.moe_layers:
            raise ValueError("routing profile: 'temporal' needs one entry per MoE layer")
        for l, row in rows.items():
            lists = [[int(c) for c in row[name]] for name in ("before", "after", "both")]
            if any(len(counts) != self.num_experts for counts in lists):
                raise ValueError(f"routing profile: 'temporal' layer {l} needs num_experts counts per list")
            self.pairs[l] = int(row["pairs"])
            self.before[l], self.after[l], self.both[l] = lists


def _table_from_json(rows: dict) -> dict[str, tuple[int, Counter]]:
    return {key: (int(v["seen"]), Counter({int(e): int(c) for e, c in v["counts"].items()})) for key, v in rows.items()}


def predictor_quality(profile: RoutingProfile, tokens, k: int) -> dict[str, float]:
    """Predict each token's top-k experts per MoE layer (history: its earlier layers) against the
    actual ones. precision = hits / predicted, recall = hits / actual."""
    if k < 1:
        raise ValueError(f"k={k}: expected >= 1")
    hits = predicted = actual = 0
    for routing in tokens:
        history: Routing = {}
        for layer in sorted(routing):
            guess = {e for e, _ in profile.predict(layer, history)[:k]}
            hits += len(guess & set(routing[layer]))
            predicted += len(guess)
            actual += len(routing[layer])
            history[layer] = routing[layer]
    return {"precision": hits / predicted if predicted else 0.0, "recall": hits / actual if actual else 0.0}
