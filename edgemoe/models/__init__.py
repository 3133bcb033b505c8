"""Architecture registry, keyed by config.json's model_type. One file per architecture."""

from __future__ import annotations

from types import ModuleType

from ..errors import UnsupportedModelError
from . import (deepseek_v2, deepseek_v3, gpt_oss, mixtral, olmoe, phimoe, qwen2_moe, qwen3_moe,
               switch_transformers)
from ..spec import ExpertNames, ModelSpec, TensorNames

ARCHITECTURES: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (mixtral, qwen2_moe, qwen3_moe, olmoe,
                                                                   deepseek_v2, deepseek_v3, phimoe, gpt_oss,
                                                                   switch_transformers)}


def architecture(model_type: str | None, where: str = "config.json") -> ModuleType:
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(f"{where}: model_type {model_type!r} is not supported "
                                    f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[model_type]


__all__ = ["ARCHITECTURES", "ExpertNames", "ModelSpec", "TensorNames", "architecture"]
