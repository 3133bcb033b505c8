"""Routing replay: a model's routers replaced by a recorded trace (docs/trace-format.md), so that a
random-weight model (tools/make_synthetic_model.py) routes as a real model did, while attention,
kernels, I/O, preload and eviction run for real (`edgemoe bench --replay`).

The trace's tokens form one stream, in order. The token at position p of any sequence takes the
stream's token p (wrapping around). MoE layer i of the model takes the trace's i-th MoE layer. A
trace with fewer MoE layers than the model is refused: repeating its layers over a deeper model
would route layer l and layer l + depth alike, a cross-layer correlation no real model has, and
would flatter any preload that learns it. Generate a trace of the model's depth instead
(tools/make_routing_trace.py). The trace's experts and top-k must fit the model.

Shapes: T tokens in the step, A experts per token.
"""

from __future__ import annotations

import torch

from edgemoe.scheduling.profile import TraceRecord


def layer_map(trace_layers: list[int], moe_layers: list[int], source: str = "trace") -> dict[int, int]:
    """Model MoE layer -> the trace layer that drives it: the i-th MoE layer takes the i-th trace layer."""
    if len(trace_layers) < len(moe_layers):
        raise ValueError(f"{source}: {len(trace_layers)} MoE layers for a model with {len(moe_layers)}; repeating "
                         f"them would invent cross-layer correlation: record a trace of the model's depth or "
                         f"generate one (tools/make_routing_trace.py --layers {len(moe_layers)})")
    return dict(zip(moe_layers, trace_layers))


def records_for_model(records: list[TraceRecord], moe_layers: list[int], source: str = "trace") -> list[TraceRecord]:
    """The trace as the model replays it: one record per token and model MoE layer, numbered as the
    model's (so that a routing profile built from it fits the model)."""
    trace_layers = sorted({r.layer for r in records})
    if trace_layers == list(moe_layers):
        return list(records)
    by_token: dict[tuple, dict[int, TraceRecord]] = {}
    for r in records:
        by_token.setdefault((r.seq, r.token), {})[r.layer] = r
    mapping = layer_map(trace_layers, moe_layers, source)
    return [TraceRecord(seq, token, layer, routing[source].experts, routing[source].weights)
            for (seq, token), routing in by_token.items() if set(routing) == set(trace_layers)
            for layer, source in mapping.items()]


class RoutingReplay:
    def __init__(self, records: list[TraceRecord], moe_layers: list[int], num_experts: int, top_k: int,
                 source: str = "trace"):
        if not records:
            raise ValueError(f"{source}: the trace is empty")
        trace_layers = sorted({r.layer for r in records})
        tokens: dict[tuple, dict[int, TraceRecord]] = {}
        for r in records:
            tokens.setdefault((r.seq, r.token), {})[r.layer] = r
        biggest = max(max(r.experts) for r in records)
        if biggest >= num_experts or any(len(r.experts) != top_k for r in records):
            raise ValueError(f"{source}: its routing (experts up to {biggest}, top-k "
                             f"{sorted({len(r.experts) for r in records})}) does not fit a model with "
                             f"{num_experts} experts, top-{top_k}")
        self.layer_of = layer_map(trace_layers, moe_layers, source)
        self.stream = [routing for routing in tokens.values() if set(routing) == set(trace_layers)]
        if not self.stream:
            raise ValueError(f"{source}: no token has a record for every layer {trace_layers}")

    def route(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, A] float32, experts [T, A] int64) for the step's token positions [T]."""
        trace_layer = self.layer_of[layer]
        picked = [self.stream[p % len(self.stream)][trace_layer] for p in positions.tolist()]
        return (torch.tensor([r.weights for r in picked], dtype=torch.float32),
                torch.tensor([r.experts for r in picked], dtype=torch.long))

    def attach(self, model) -> "RoutingReplay":
        model.routing_override = self.route
        return self
