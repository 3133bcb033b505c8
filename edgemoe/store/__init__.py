"""edgemoe.store: the tiered expert store (format: docs/store-format.md).

    from edgemoe.store import open_store
    with open_store("model.store", ram="512MiB", policy="expected-use") as store:
        for entry in store.experts(): ...              # layer, expert, bits, file, offset, length
        e = store.get(layer=0, expert=3)               # packed arrays (e.tensors) ...
        w = e.dequantize()                             # ... or dense tensors {"gate", "up", "down"}
        store.prefetch([(1, 0), (1, 5)])               # background loader
        print(store.stats.to_dict())

Stores are written by edgemoe.convert.
"""

from .format import ExpertEntry, Manifest, StoreError, read_manifest
from .inspect import inspect_store
from edgemoe.options import check_device, parse_bytes

from .profile_file import find_routing_profile, load_routing_profile, save_routing_profile
from .tiers import ResidentExpert, StoreStats, TieredStore, open_store

__all__ = ["ExpertEntry", "Manifest", "ResidentExpert", "StoreError", "StoreStats", "TieredStore",
           "check_device", "find_routing_profile", "inspect_store", "load_routing_profile", "open_store",
           "parse_bytes", "read_manifest", "save_routing_profile"]
