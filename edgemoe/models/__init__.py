"""Architecture registry, keyed by config.json's model_type. One file per architecture."""

from __future__ import annotations

from dataclasses import fields
from types import ModuleType

from ..errors import CheckpointError, UnsupportedModelError
from . import (deepseek_v2, deepseek_v3, gpt_oss, mixtral, olmoe, phimoe, qwen2_moe, qwen3_moe,
               switch_transformers)
from .common import KINDS, Part
from ..spec import ExpertNames, ModelSpec, TensorNames

ARCHITECTURES: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (mixtral, qwen2_moe, qwen3_moe, olmoe,
                                                                   deepseek_v2, deepseek_v3, phimoe, gpt_oss,
                                                                   switch_transformers)}


def architecture(model_type: str | None, where: str = "config.json") -> ModuleType:
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise UnsupportedModelError(f"{where}: model_type {model_type!r} is not supported "
                                    f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[model_type]


def parse_spec(config: dict, where: str = "config.json") -> ModelSpec:
    """The ModelSpec of a config.json's dict; every error names `where` (the file) and the field."""
    arch = architecture(config.get("model_type"), where)
    try:
        return arch.parse_config(config)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None


def part_from_fields(d: dict, part: type[Part]) -> Part:
    """The `part` (Router, ExpertKind, Rotary, Attention) a manifest's spec names (part.key: kind,
    absent in manifests written before that key existed: part.kind_before_key; the kind's parameters
    beside it), taking the keys of every kind of `part` out of `d`: manifests written before the kinds
    were declared by their architecture files list every kind's parameters, at their defaults where
    unused. The architecture files above have registered their kinds."""
    kinds = KINDS[part.key]
    kind = d.pop(part.key) if part.key in d else part.kind_before_key(d)
    if kind not in kinds:
        raise CheckpointError(f"{part.key}={kind!r}: expected one of {', '.join(kinds)}")
    params = {f.name: d[f.name] for f in fields(kinds[kind]) if f.name in d}
    for other in kinds.values():
        for f in fields(other):
            d.pop(f.name, None)
    return kinds[kind](**params)


__all__ = ["ARCHITECTURES", "ExpertNames", "ModelSpec", "TensorNames", "architecture",
           "parse_spec", "part_from_fields"]
