"""Resolve and read a checkpoint's tensors into canonical roles, with loud failures.

The plan is checked from the safetensors headers alone before any weight is read: every canonical
role found with the right shape, every checkpoint tensor used. All problems are reported in one error.
Experts may be stored per expert or fused (stacked over experts; GPT-OSS's interleaved, transposed
and possibly MXFP4-quantized layout); all resolve to the same roles, float (MXFP4 decoded on read).

Shapes: E experts, I expert hidden, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .checkpoint import Checkpoint, check_finite, read_slice
from .errors import CheckpointError
from .mxfp4 import check_mxfp4_shapes, decode_mxfp4
from .spec import ExpertNames, ModelSpec, TensorNames

EXPERT_ROLES = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertSource:
    """Where one expert's three matrices are: per-expert tensors, or slices of the fused ones
    (layout: one of LAYOUTS)."""

    layer: int
    expert: int
    names: ExpertNames
    layout: str

    def tensors(self) -> tuple[str, ...]:
        """The checkpoint tensors this expert is read from."""
        n = self.names
        if self.layout == "per_expert":
            return tuple(n.per_expert(self.expert).values())
        if self.layout == "gpt_oss_mxfp4":
            return tuple(_mxfp4_names(n))
        return n.fused_gate_up, n.fused_down


LAYOUTS = ("per_expert", "stacked", "gpt_oss", "gpt_oss_mxfp4")


@dataclass
class WeightPlan:
    dense: dict[str, str]                    # canonical role -> checkpoint tensor
    experts: dict[tuple[int, int], ExpertSource]


def _short_list(items: list[str], limit: int = 8) -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _layer_layout(ckpt: Checkpoint, spec: ModelSpec, names: ExpertNames, problems: list[str]) -> str | None:
    """Which expert layout (LAYOUTS) a layer uses; None (with problems noted) when none is complete."""
    per_expert = [n for e in range(spec.num_experts) for n in names.per_expert(e).values()]
    if all(n in ckpt for n in per_expert):
        expected = spec.expert_shapes()
        for e in range(spec.num_experts):
            for role, name in names.per_expert(e).items():
                if ckpt.shape(name) != expected[role]:
                    problems.append(f"tensor {name} has shape {ckpt.shape(name)}, expected {expected[role]}")
        return "per_expert"
    E, I, D = spec.num_experts, spec.expert_hidden, spec.hidden_size
    gate_up, down = names.fused_gate_up, names.fused_down
    if names.fused == "gpt_oss" and any(n in ckpt for n in _mxfp4_names(names)):
        return _mxfp4_layout(ckpt, spec, names, problems)
    if gate_up in ckpt and down in ckpt:
        shapes = {"stacked": ((E, 2 * I, D), (E, D, I)), "gpt_oss": ((E, D, 2 * I), (E, I, D))}[names.fused]
        for name, shape in zip((gate_up, down), shapes):
            if ckpt.shape(name) != shape:
                problems.append(f"tensor {name} has shape {ckpt.shape(name)}, expected {shape}")
        return names.fused
    if names.fused == "gpt_oss":
        missing = [n for n in (gate_up, down) if n not in ckpt]
        problems.append(f"missing {_short_list(missing)} (nor MXFP4 {gate_up}_blocks / _scales)")
    else:
        problems.append("missing " + _short_list([n for n in per_expert if n not in ckpt]) + f" (nor fused {gate_up})")
    return None


def _mxfp4_names(names: ExpertNames) -> list[str]:
    return [f"{n}_{part}" for n in (names.fused_gate_up, names.fused_down) for part in ("blocks", "scales")]


def _mxfp4_layout(ckpt: Checkpoint, spec: ModelSpec, names: ExpertNames, problems: list[str]) -> str | None:
    """GPT-OSS's MXFP4 experts: all four tensors there, blocks and scales of gate_up [E, 2I, D] and
    down [E, D, I]; None (with problems noted) otherwise."""
    missing = [n for n in _mxfp4_names(names) if n not in ckpt]
    if missing:
        problems.append(f"missing {_short_list(missing)} (MXFP4 experts)")
        return None
    E, I, D = spec.num_experts, spec.expert_hidden, spec.hidden_size
    for name, rows_cols in ((names.fused_gate_up, (E, 2 * I, D)), (names.fused_down, (E, D, I))):
        problems += check_mxfp4_shapes(f"{name}_blocks", ckpt.shape(f"{name}_blocks"),
                                       ckpt.shape(f"{name}_scales"), rows_cols)
    return "gpt_oss_mxfp4"


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
        layout = _layer_layout(ckpt, spec, layer_names, problems)
        for e in range(spec.num_experts):
            experts[layer, e] = ExpertSource(layer, e, layer_names, layout or "per_expert")
    used = {names.dense[r] for r in expected if r in names.dense}
    for src in experts.values():
        used.update(src.tensors())
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
    if src.layout == "per_expert":
        return {role: ckpt.get(name, dtype) for role, name in src.names.per_expert(src.expert).items()}
    if src.layout == "stacked":
        gate_up = read_slice(ckpt, src.names.fused_gate_up, src.expert, dtype)  # [2I, D]
        half = gate_up.shape[0] // 2
        return {"gate": gate_up[:half].contiguous(), "up": gate_up[half:].contiguous(),
                "down": read_slice(ckpt, src.names.fused_down, src.expert, dtype)}
    if src.layout == "gpt_oss":
        gate_up = read_slice(ckpt, src.names.fused_gate_up, src.expert, dtype).T    # [2I, D], interleaved rows
        down = read_slice(ckpt, src.names.fused_down, src.expert, dtype).T          # [D, I]
    else:   # gpt_oss_mxfp4: decoded to float32, then cast (so no more than one expert is ever decoded)
        gate_up, down = (_read_mxfp4(ckpt, name, src.expert).to(dtype or torch.float32)
                         for name in (src.names.fused_gate_up, src.names.fused_down))
    return {"gate": gate_up[0::2].contiguous(), "up": gate_up[1::2].contiguous(), "down": down.contiguous()}


def _read_mxfp4(ckpt: Checkpoint, name: str, expert: int) -> torch.Tensor:
    """Expert `expert`'s slice of an MXFP4 pair name_blocks / name_scales, decoded: float32 [R, C]."""
    blocks = read_slice(ckpt, f"{name}_blocks", expert, packed=True)    # [R, C/32, 16]
    scales = read_slice(ckpt, f"{name}_scales", expert, packed=True)    # [R, C/32]
    where = f"{ckpt.tensors[name + '_blocks'].file}: tensor {name + '_blocks'!r} [{expert}]"
    return check_finite(decode_mxfp4(blocks, scales, where), f"{where}, decoded")   # a scale of 255 is 2^128


def read_dense(ckpt: Checkpoint, plan: WeightPlan, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {role: ckpt.get(name, dtype) for role, name in plan.dense.items()}


def iter_experts(ckpt: Checkpoint, plan: WeightPlan,
                 dtype: torch.dtype | None = None) -> Iterator[tuple[tuple[int, int], dict[str, torch.Tensor]]]:
    """Experts one at a time, in (layer, expert) order: bounded memory for converters."""
    for key in sorted(plan.experts):
        yield key, read_expert(ckpt, plan.experts[key], dtype)
