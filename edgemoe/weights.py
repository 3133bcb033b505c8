"""Resolve and read a checkpoint's tensors into canonical roles, with loud failures.

The plan is checked from the safetensors headers alone before any weight is read: every canonical
role found with the right shape, every checkpoint tensor used. All problems are reported in one error.
Experts may be stored per expert or fused (stacked over experts); both resolve to the same roles.

Shapes: E experts, I expert hidden, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .checkpoint import Checkpoint, read_slice
from .errors import CheckpointError
from .spec import ExpertNames, ModelSpec, TensorNames

EXPERT_ROLES = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertSource:
    """Where one expert's three matrices are: per-expert tensors, or slices of the fused ones."""

    layer: int
    expert: int
    names: ExpertNames
    fused: bool


@dataclass
class WeightPlan:
    dense: dict[str, str]                    # canonical role -> checkpoint tensor
    experts: dict[tuple[int, int], ExpertSource]


def _short_list(items: list[str], limit: int = 8) -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _layer_is_fused(ckpt: Checkpoint, spec: ModelSpec, names: ExpertNames, problems: list[str]) -> bool | None:
    """Which expert layout a layer uses; None (with problems noted) when neither is complete."""
    per_expert = [n for e in range(spec.num_experts) for n in names.per_expert(e).values()]
    if all(n in ckpt for n in per_expert):
        expected = spec.expert_shapes()
        for e in range(spec.num_experts):
            for role, name in names.per_expert(e).items():
                if ckpt.shape(name) != expected[role]:
                    problems.append(f"tensor {name} has shape {ckpt.shape(name)}, expected {expected[role]}")
        return False
    if names.fused_gate_up in ckpt and names.fused_down in ckpt:
        E, I, D = spec.num_experts, spec.expert_hidden, spec.hidden_size
        for name, shape in ((names.fused_gate_up, (E, 2 * I, D)), (names.fused_down, (E, D, I))):
            if ckpt.shape(name) != shape:
                problems.append(f"tensor {name} has shape {ckpt.shape(name)}, expected {shape}")
        return True
    problems.append("missing " + _short_list([n for n in per_expert if n not in ckpt]) +
                    f" (nor fused {names.fused_gate_up})")
    return None


def plan_weights(ckpt: Checkpoint, spec: ModelSpec, names: TensorNames) -> WeightPlan:
    """Check the checkpoint against the spec from headers only; raise one error listing every problem."""
    problems: list[str] = []
    expected = spec.dense_shapes()
    for role, shape in expected.items():
        name = names.dense.get(role)
        if name is None:
            problems.append(f"no checkpoint name for role {role}")  # a bug in an architecture file
        elif name not in ckpt:
            problems.append(f"missing tensor {name} (for {role})")
        elif ckpt.shape(name) != shape:
            problems.append(f"tensor {name} has shape {ckpt.shape(name)}, expected {shape} (for {role})")
    experts = {}
    for layer in spec.moe_layer_ids:
        layer_names = names.experts[layer]
        fused = _layer_is_fused(ckpt, spec, layer_names, problems)
        for e in range(spec.num_experts):
            experts[layer, e] = ExpertSource(layer, e, layer_names, bool(fused))
    used = {names.dense[r] for r in expected if r in names.dense}
    for src in experts.values():
        used.update((src.names.fused_gate_up, src.names.fused_down) if src.fused
                    else src.names.per_expert(src.expert).values())
    unused = [n for n in sorted(set(ckpt.tensors) - used)
              if not n.endswith(names.ignored_suffixes) and not n.startswith(names.ignored_prefixes)]
    if unused:
        problems.append("unused tensors " + _short_list(unused))
    if problems:
        raise CheckpointError(f"{ckpt.path}: checkpoint does not match {spec.model_type} config: "
                              + "; ".join(problems[:12]) + (f"; ... {len(problems) - 12} more" if len(problems) > 12 else ""))
    return WeightPlan({r: names.dense[r] for r in expected}, experts)


def read_expert(ckpt: Checkpoint, src: ExpertSource, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One expert's gate [I, D], up [I, D], down [D, I]."""
    if not src.fused:
        return {role: ckpt.get(name, dtype) for role, name in src.names.per_expert(src.expert).items()}
    gate_up = read_slice(ckpt, src.names.fused_gate_up, src.expert, dtype)  # [2I, D]
    half = gate_up.shape[0] // 2
    return {"gate": gate_up[:half].contiguous(), "up": gate_up[half:].contiguous(),
            "down": read_slice(ckpt, src.names.fused_down, src.expert, dtype)}


def read_dense(ckpt: Checkpoint, plan: WeightPlan, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {role: ckpt.get(name, dtype) for role, name in plan.dense.items()}


def iter_experts(ckpt: Checkpoint, plan: WeightPlan,
                 dtype: torch.dtype | None = None) -> Iterator[tuple[tuple[int, int], dict[str, torch.Tensor]]]:
    """Experts one at a time, in (layer, expert) order: bounded memory for converters."""
    for key in sorted(plan.experts):
        yield key, read_expert(ckpt, plan.experts[key], dtype)
