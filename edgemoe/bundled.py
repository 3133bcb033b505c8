"""The model that ships inside the package: a small Mixtral trained on Shakespeare (tools/train_tiny_moe.py)."""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled" / "shakespeare-moe"


def bundled_model_path() -> Path:
    if not (BUNDLED_DIR / "config.json").exists():
        raise CheckpointError(f"{BUNDLED_DIR}: the bundled model is missing from this installation")
    return BUNDLED_DIR


def bundled_text(name: str) -> Path:
    """The bundled evaluation ("eval.txt") or calibration ("calib.txt") text."""
    return bundled_model_path() / name
