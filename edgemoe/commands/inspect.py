"""`edgemoe inspect`: summarise a store, and where its experts would be placed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from edgemoe import options
from edgemoe.plots import plot_width_map

from .common import ram_breakdown_text, refuse_overwrite, size
from .options import JSON, force_option


def inspect(
    store_path: Path = typer.Argument(..., metavar="STORE", help="Store directory."),
    ram: Optional[str] = typer.Option(None, "--ram", help="Show where experts would be placed with this RAM "
                                      "capacity (bytes, a share of the expert bytes, or auto: the budget `edgemoe "
                                      "run` would choose here, and why)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw the width map (layer x expert) to this PNG "
                                        "(needs matplotlib: pip install 'edgemoe[plot]')."),
    as_json: bool = JSON,
    force: bool = force_option("--plot file"),
):
    """Summarise a store: model, sizes per layer and width, bits per weight, the width map, placement."""
    from edgemoe.loader import auto_ram
    from edgemoe.store import inspect_store, read_manifest

    options.parse_bytes(ram, "--ram", allow_share=True, allow_auto=True)
    if plot is not None:
        refuse_overwrite(plot, [store_path], force)
    # --ram auto: the RAM a run here would get (the commands' default --dense-bits, the whole context)
    ram_auto = auto_ram(read_manifest(store_path)) if ram == "auto" else None
    summary = inspect_store(store_path, ram=ram_auto[0] if ram_auto else ram)
    if ram_auto:
        summary["ram_auto"] = ram_auto[1]
    if plot is not None:
        plot_width_map(summary, plot)
    if as_json:
        print(json.dumps(summary, indent=1))
        return
    console = Console()
    m = summary["model"]
    console.print(f"{store_path}: {m['model_type']}, {m['layers']} layers, {m['experts']} experts/layer, "
                  f"top-{m['top_k']}, hidden {m['hidden']}, expert hidden {m['expert_hidden']}; "
                  f"format v{summary['version']}, {_quantization_text(summary['quantization'])}")
    console.print(f"experts {size(summary['expert_bytes'])} at {summary['bits_per_weight']:.3f} bits/weight, "
                  f"dense {size(summary['dense_bytes'])}")
    if ram_auto:
        console.print(ram_breakdown_text(ram_auto[1]))
    if summary["fallback"]:
        f = summary["fallback"]
        console.print(f"fallback copies: {f['experts']} experts at INT{f['bits']}, {size(f['bytes'])}")
    table = Table("layer", *[f"INT{b}" for b in (2, 4, 8)], "bytes", *(["in RAM"] if ram else []))
    for row in summary["layers"]:
        table.add_row(str(row["layer"]), *[str(row["widths"].get(str(b), 0)) for b in (2, 4, 8)],
                      size(row["bytes"]), *([str(row["resident"])] if ram else []))
    console.print(table)
    width_map = Table("layer", *[f"e{e}" for e in range(m["experts"])], title="bits per expert")
    for layer, bits in summary["widths"].items():
        width_map.add_row(layer, *[str(b) for b in bits])
    console.print(width_map)
    if plot is not None:
        console.print(f"width map drawn to {plot}")


def _quantization_text(q: dict) -> str:
    group = f"groups of {q['group_size']}" if q.get("group_size") else "one group per row"
    return f"quantized by {q.get('method', '?')}, {group}"

