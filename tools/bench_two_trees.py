"""Decode steps of two source trees of edgemoe in one process, alternated token by token.

    git worktree add /tmp/before REV --detach
    python tools/bench_two_trees.py STORE --before /tmp/before --prefill 512 --tokens 64 --threads 2 [--batch 4] [--ram 25%]

Loads STORE with this tree's edgemoe and with the one at --before (imported as the package
`edgemoe_before`), prefills the same random prompts in each (--batch of them, one at a time), then
decodes greedily, one step of each tree in turn, timing each forward step: a step takes the next
token of every prompt, as a server's step does for its requests. On these shared 2-vCPU machines one process's speed drifts
by up to 2x from the next one's; alternating within one process keeps the drift out of the ratio.
The two models' greedy tokens may part after a while (a change of rounding, on a random-weight
checkpoint whose top logits are close): each then decodes its own text, at the same positions.

numba caches compiled functions by source file, but pickles the module's name with them: so that
`edgemoe_before`'s entries never reach a plain run of that tree, the run uses its own cache folder
(NUMBA_CACHE_DIR, default a folder under the system's temporary directory) unless one is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(tempfile.gettempdir()) / "edgemoe-two-trees-numba"))

import numba  # noqa: E402  (after NUMBA_CACHE_DIR)
import numpy as np  # noqa: E402
import torch  # noqa: E402


def load_tree(name: str, root: Path):
    """The edgemoe package of the source tree at root, imported as `name`."""
    spec = importlib.util.spec_from_file_location(name, root / "edgemoe" / "__init__.py",
                                                  submodule_search_locations=[str(root / "edgemoe")])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store")
    parser.add_argument("--before", required=True, type=Path, help="the other tree's root")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dense-bits", default="auto", choices=["auto", "none", "8", "4"])
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together in each step")
    parser.add_argument("--ram", default=None, help="the RAM tier's budget (bytes, 512MiB, 25%%; default unlimited)")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: give at least 1")
    if not (args.before / "edgemoe" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: no edgemoe/__init__.py there (give a source tree's root)")
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    import edgemoe
    trees = {"before": load_tree("edgemoe_before", args.before.resolve()), "after": edgemoe}
    dense_bits = {"auto": "auto", "none": None}.get(args.dense_bits) or int(args.dense_bits)
    prompts = [torch.randint(3, 1000, (args.prefill,), generator=torch.Generator().manual_seed(i))
               for i in range(args.batch)]
    runs = {}
    for name, package in trees.items():
        model = package.load(args.store, dense_bits=dense_bits, threads=args.threads, ram=args.ram)
        caches = [model.new_cache() for _ in prompts]
        segment = sys.modules[package.__name__ + ".model"].Segment
        start = time.perf_counter()
        tokens = [int(model.forward(p, [segment(c, args.prefill)], last_only=True)[-1].argmax())
                  for p, c in zip(prompts, caches)]
        print(f"{name}: prefill {args.batch} x {args.prefill} tokens {time.perf_counter() - start:.2f} s "
              "(compiles on an empty cache)")
        runs[name] = {"model": model, "segment": segment, "caches": caches, "tokens": tokens, "times": []}
    for step in range(3 + args.tokens):   # 3 warm-up steps each, not timed
        for run in runs.values():
            start = time.perf_counter()
            logits = run["model"].forward(torch.tensor(run["tokens"]), [run["segment"](c, 1) for c in run["caches"]],
                                          last_only=True)
            if step >= 3:
                run["times"].append(time.perf_counter() - start)
            run["tokens"] = logits.argmax(-1).tolist()
    medians = {name: float(np.median(run["times"])) for name, run in runs.items()}
    for name, run in runs.items():
        print(f"{name}: median step {medians[name] * 1e3:.2f} ms, fastest {min(run['times']) * 1e3:.2f} ms "
              f"over {args.tokens} steps of {args.batch} token(s) after {args.prefill}")
    print(f"after against before: {medians['before'] / medians['after']:.3f}x (median steps)")


if __name__ == "__main__":
    main()
