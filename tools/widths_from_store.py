#!/usr/bin/env python
"""A width file (edgemoe convert --widths) for a deeper model, from a store's per-expert widths.

    python tools/widths_from_store.py STORE --layers 32 [--experts 8] -o widths.json

Layer l of the target (l < --layers) takes the widths of the store's MoE layer l * L // layers
(L: the store's MoE layers), expert for expert: the width mix a budget search chose, laid over a
model that cannot be searched (a random-weight benchmark checkpoint has no quality to measure).
The target must have as many experts per layer as the store.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgemoe.store import read_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--layers", type=int, required=True, help="MoE layers of the target model")
    parser.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args()
    manifest = read_manifest(args.store)
    spec = manifest.spec
    source = spec.moe_layer_ids
    widths = {str(layer): [manifest.experts[source[layer * len(source) // args.layers], e].bits
                           for e in range(spec.num_experts)] for layer in range(args.layers)}
    args.out.write_text(json.dumps({"widths": widths}, indent=1))
    counts = {b: sum(row.count(b) for row in widths.values()) for b in (2, 4, 8)}
    print(f"wrote {args.out}: {args.layers} layers x {spec.num_experts} experts, INT2/4/8 = "
          f"{counts[2]}/{counts[4]}/{counts[8]} (from {args.store})")


if __name__ == "__main__":
    main()
