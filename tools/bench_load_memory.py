#!/usr/bin/env python
"""A store's load in memory: RSS when edgemoe is imported, the peak while `edgemoe.load` runs (a thread
reads /proc/self/status's VmRSS every 10 ms), and RSS once it has returned. Linux only.

    python tools/bench_load_memory.py STORE [--dense-bits auto] [--ram 0]

Run it in a fresh process per code version (PYTHONPATH=...) to compare loads.
"""

from __future__ import annotations

import argparse
import threading
import time


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) >> 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store")
    parser.add_argument("--dense-bits", default="auto")
    parser.add_argument("--ram", default="0")
    args = parser.parse_args()
    import torch  # noqa: F401  (the runtime's own memory counted before the load)

    import edgemoe
    imported, peak, loading = rss_mib(), [0], [True]

    def watch() -> None:
        while loading[0]:
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.01)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    bits = args.dense_bits if args.dense_bits in ("auto", "none") else int(args.dense_bits)
    model = edgemoe.load(args.store, ram=args.ram, dense_bits=bits, preload="none")
    loading[0] = False
    watcher.join()
    print(f"{args.store}: RSS after import {imported} MiB, peak while loading {max(peak[0], rss_mib())} MiB, "
          f"after load {rss_mib()} MiB")
    model.close()


if __name__ == "__main__":
    main()
