"""`edgemoe.load(path)`: a model from a Hugging Face checkpoint directory (everything in RAM)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .checkpoint import Checkpoint, read_json
from .errors import CheckpointError
from .experts import DenseExpert, InMemoryExperts
from .model import MoEModel
from .models import architecture
from .models.spec import ModelSpec
from .tokenizer import Tokenizer
from .weights import iter_experts, plan_weights, read_dense


def read_spec(ckpt: Checkpoint) -> ModelSpec:
    arch = architecture(ckpt.config.get("model_type"), where=str(ckpt.path / "config.json"))
    try:
        return arch.parse_config(ckpt.config)
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: {e}") from None


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> MoEModel:
    """Load a checkpoint directory; every weight cast to `dtype` (float32 by default: exact on CPU)."""
    ckpt = Checkpoint(path)
    spec = read_spec(ckpt)
    plan = plan_weights(ckpt, spec, architecture(spec.model_type).tensor_names(spec))
    dense = read_dense(ckpt, plan, dtype)
    experts = {key: DenseExpert(**weights) for key, weights in iter_experts(ckpt, plan, dtype)}
    ckpt.close()
    directory = Path(path)
    tokenizer = Tokenizer(directory) if (directory / "tokenizer.json").exists() else None
    gen_path = directory / "generation_config.json"
    generation_config = read_json(gen_path) if gen_path.exists() else {}
    return MoEModel(spec, dense, InMemoryExperts(experts), tokenizer, generation_config, name=directory.name)


def load(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> MoEModel:
    """A model from a checkpoint directory. (Stores are added by the store issue.)"""
    return load_checkpoint(path, dtype)
