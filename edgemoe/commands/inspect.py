"""`edgemoe inspect`: summarise a store, and where its experts would be placed."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import ram_breakdown_text, refuse_overwrite, size
from .options import force_option, ram_option

def inspect(
    store: Path = typer.Argument(..., help="Store directory."),
    ram: Optional[str] = ram_option(None, help_text="Show where experts would be placed with this RAM capacity "
                                     "(bytes, a share of the expert bytes, or auto: the budget `edgemoe run` "
                                     "would choose here, and why)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw the width map (layer x expert) to this PNG "
                                        "(needs matplotlib: pip install 'edgemoe[plot]')."),
    as_json: bool = typer.Option(False, "--json"),
    force: bool = force_option("--plot file"),
):
    """Summarise a store: model, sizes per layer and width, bits per weight, the width map, placement."""
    import json

    from edgemoe.store import inspect_store, parse_bytes

    parse_bytes(ram, "--ram", allow_share=True, allow_auto=True)
    if plot is not None:
        refuse_overwrite(plot, [store], force)
    budget = _auto_ram_of(store) if ram == "auto" else None
    summary = inspect_store(store, ram=budget[0] if budget else ram)
    if budget:
        summary["ram_auto"] = budget[1]
    if plot is not None:
        from edgemoe.plots import plot_width_map
        plot_width_map(summary, plot)
    if as_json:
        print(json.dumps(summary, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = summary["model"]
    console.print(f"{store}: {m['model_type']}, {m['layers']} layers, {m['experts']} experts/layer, top-{m['top_k']}, "
                  f"hidden {m['hidden']}, expert hidden {m['expert_hidden']}; format v{summary['version']}, "
                  f"{_quantization_text(summary['quantization'])}")
    console.print(f"experts {size(summary['expert_bytes'])} at {summary['bits_per_weight']:.3f} bits/weight, "
                  f"dense {size(summary['dense_bytes'])}")
    if budget:
        console.print(ram_breakdown_text(budget[1]))
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


def _auto_ram_of(store: Path) -> tuple[int, dict]:
    """--ram auto for `edgemoe inspect`: the budget a run here would get (the commands' default
    --dense-bits, the model's whole context)."""
    from edgemoe.store import read_manifest

    from edgemoe.loader import auto_ram
    return auto_ram(read_manifest(store))
