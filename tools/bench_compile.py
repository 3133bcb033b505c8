"""What a user's first decode pays to compile: a store's first tokens on an empty numba cache, each
kernel's compile time (numba's compile events; a kernel's time includes the functions it compiles
for itself), against the same tokens once the cache holds them.

    python tools/bench_compile.py [STORE] [--kv-dtype float32 bfloat16] [--dense-bits 4]

STORE defaults to the bundled model converted at 4 bits (into a temporary directory). Every expert is
made resident first, so that the decode engine's one-call step runs, as on a machine whose RAM holds
the experts. Each KV dtype runs in a fresh process on a fresh cache directory, then once more on that
cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def first_tokens(store: str, kv_dtype: str, dense_bits: int) -> dict:
    """In this process: load, make every expert resident, decode a few tokens; the compile events."""
    from numba.core import event

    compiled: dict[str, float] = defaultdict(float)
    depth = []

    class Listener(event.Listener):
        def on_start(self, ev):
            depth.append(time.perf_counter())

        def on_end(self, ev):
            started = depth.pop()
            if not depth:   # a top-level compile: the functions it compiles for itself are inside it
                compiled[ev.data["dispatcher"].py_func.__qualname__] += time.perf_counter() - started

    event.register("numba:compile", Listener())
    import edgemoe

    start = time.perf_counter()
    with edgemoe.load(store, dense_bits=dense_bits, kv_dtype=kv_dtype, preload="none", threads=1) as model:
        for entry in model.store.experts():
            model.store.get(*entry.key)
        model.generate("ROMEO:", max_new_tokens=4, temperature=0)
    return {"seconds": time.perf_counter() - start, "compiled": dict(compiled)}


def run_child(store: str, kv_dtype: str, dense_bits: int, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, __file__, store, "--child", "--kv-dtype", kv_dtype,
                          "--dense-bits", str(dense_bits)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


def default_store(directory: str) -> str:
    from edgemoe.bundled import bundled_model_path
    from edgemoe.convert import convert

    store = Path(directory) / "bundled-int4"
    convert(bundled_model_path(), store, bits=4)
    return str(store)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", nargs="?")
    ap.add_argument("--kv-dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--dense-bits", type=int, default=4)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(first_tokens(args.store, args.kv_dtype[0], args.dense_bits)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        store = args.store or default_store(scratch)
        for kv_dtype in args.kv_dtype:
            cache = tempfile.mkdtemp(dir=scratch)
            cold = run_child(store, kv_dtype, args.dense_bits, cache)
            warm = run_child(store, kv_dtype, args.dense_bits, cache)
            print(f"kv {kv_dtype}: load and 4 tokens {cold['seconds']:.1f} s on an empty cache, "
                  f"{warm['seconds']:.1f} s on its cache")
            for name, seconds in sorted(cold["compiled"].items(), key=lambda kv: -kv[1]):
                if seconds >= 0.5:
                    print(f"    {seconds:6.1f} s  {name}")


if __name__ == "__main__":
    main()
