#!/usr/bin/env python
"""A checkpoint's first N decoder layers as a checkpoint of its own (embeddings, final norm and LM
head kept): per-layer costs of a large model measured in small memory (docs/budget.md, "Cost").

    python tools/slice_layers.py MODEL_DIR --layers 2 -o OUT_DIR

Decoder-only checkpoints whose layer tensors are named `model.layers.<i>.` (Mixtral, Qwen-MoE, ...).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {name: model_dir / "model.safetensors" for name in f.keys()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--out", "-o", type=Path, required=True)
    args = parser.parse_args()
    kept = {}
    for name, file in tensor_files(args.model).items():
        layer = LAYER.match(name)
        if layer is None or int(layer.group(1)) < args.layers:
            kept.setdefault(file, []).append(name)
    tensors = {}
    for file, names in kept.items():
        with safe_open(file, "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in names})
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((args.model / "config.json").read_text())
    config["num_hidden_layers"] = args.layers
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED:
        if (args.model / name).exists():
            shutil.copy(args.model / name, args.out / name)
    print(f"wrote {args.out}: {args.layers} of {json.loads((args.model / 'config.json').read_text())['num_hidden_layers']}"
          f" layers, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
