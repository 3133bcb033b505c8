"""A store's summary, for `edgemoe inspect` and for tools: model, sizes per layer and width, placement."""

from __future__ import annotations

from pathlib import Path

from .format import read_manifest
from .tiers import TieredStore


def inspect_store(path, ram=None) -> dict:
    manifest = read_manifest(Path(path))
    spec = manifest.spec
    placed = {}
    if ram is not None:  # where the initial placement (by profile popularity) puts experts
        with TieredStore(path, ram=ram) as store:
            placed = store.resident()
    layers = []
    for layer in spec.moe_layer_ids:
        entries = [manifest.experts[layer, e] for e in range(spec.num_experts)]
        widths: dict[str, int] = {}
        for entry in entries:
            widths[str(entry.bits)] = widths.get(str(entry.bits), 0) + 1
        layers.append({"layer": layer, "widths": widths, "bytes": sum(e.stored_length for e in entries),
                       "resident": sum(1 for e in entries if e.key in placed)})
    expert_bytes = sum(e.stored_length for e in manifest.experts.values())
    params = len(manifest.experts) * len(spec.expert_roles) * spec.expert_hidden * spec.hidden_size
    return {
        "store": str(manifest.path), "version": manifest.data["version"],
        "model": {"model_type": spec.model_type, "layers": spec.num_layers, "experts": spec.num_experts,
                  "top_k": spec.top_k, "hidden": spec.hidden_size, "expert_hidden": spec.expert_hidden},
        "quantization": manifest.quantization, "expert_bytes": expert_bytes,
        "bits_per_weight": 8 * expert_bytes / params, "dense_bytes": manifest.data["dense"]["size"],
        "fallback": {"bits": manifest.fallback_bits, "experts": len(manifest.fallback),
                     "bytes": sum(e.stored_length for e in manifest.fallback.values())} if manifest.fallback else None,
        "layers": layers,
        "widths": {str(l): [manifest.experts[l, e].bits for e in range(spec.num_experts)] for l in spec.moe_layer_ids},
    }
