"""edgemoe.store: the tiered expert store (format: docs/store-format.md).

    from edgemoe.store import open_store
    with open_store("model.store", ram="512MiB", policy="edgemoe") as store:
        for entry in store.experts(): ...              # layer, expert, bits, file, offset, length
        e = store.get(layer=0, expert=3)               # packed arrays (e.tensors) ...
        w = e.dequantize()                             # ... or dense tensors {"gate", "up", "down"}
        store.prefetch([(1, 0), (1, 5)])               # background loader
        print(store.stats.to_dict())

    from edgemoe.store import convert                  # checkpoint -> store
"""

from .format import ExpertEntry, Manifest, StoreError, read_manifest
from .inspect import inspect_store
from .tiers import ResidentExpert, StoreStats, TieredStore, check_device, open_store, parse_bytes
from .writer import ConvertReport, convert, read_widths

__all__ = ["ConvertReport", "ExpertEntry", "Manifest", "ResidentExpert", "StoreError", "StoreStats", "TieredStore",
           "check_device", "convert", "inspect_store", "open_store", "parse_bytes", "read_manifest", "read_widths"]
