"""A serving workload in one process, two source trees of edgemoe alternated (no HTTP): C clients each
submit R greedy requests one after the other (a client's next when its previous ends, so requests join
while others decode, as under `edgemoe serve`), prompts of a few tokens, --max-tokens each; the
continuous-batching engine steps until all end. Completion tokens per second of wall time, per round.

    git worktree add /tmp/before REV --detach
    python tools/bench_engine_two_trees.py STORE --before /tmp/before --clients 8 --requests 2 \\
        --max-tokens 48 --rounds 3 --threads 2

Each tree loads STORE as the commands do (--ram auto, --dense-bits auto); one warm-up round of each first (it compiles
on an empty cache). numba's cache folder: as tools/bench_two_trees.py.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_two_trees import load_tree  # noqa: E402  (sets NUMBA_CACHE_DIR before numba loads)

import numba  # noqa: E402
import torch  # noqa: E402

PROMPTS = ["ROMEO:", "JULIET:\nO", "To be, or not to be", "KING.\nWhat", "HAMLET:\n", "Now is the winter",
           "Friends, Romans", "All the world"]


def serve_round(package, model, clients: int, requests: int, max_tokens: int) -> tuple[float, int, int]:
    """One round of the workload: (wall seconds, completion tokens, engine steps)."""
    engine = importlib.import_module(package.__name__ + ".engine").Engine(model)
    options = importlib.import_module(package.__name__ + ".generate").GenerationOptions(
        max_new_tokens=max_tokens, temperature=0.0, stop_token_ids=[])
    sent = {client: 0 for client in range(clients)}

    def submit(client: int):
        sent[client] += 1
        prompt = PROMPTS[(client + sent[client]) % len(PROMPTS)]
        return engine.submit(model.tokenizer.encode(prompt), options)

    start, tokens, steps = time.perf_counter(), 0, 0
    active = {client: submit(client) for client in range(clients)}
    while active:
        engine.step()
        steps += 1
        for client, request in list(active.items()):
            if request.finish_reason is not None:
                tokens += len(request.output_ids)
                del active[client]
                if sent[client] < requests:
                    active[client] = submit(client)
    return time.perf_counter() - start, tokens, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store")
    parser.add_argument("--before", required=True, type=Path, help="the other tree's root")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not (args.before / "edgemoe" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: no edgemoe/__init__.py there (give a source tree's root)")
    if min(args.clients, args.requests, args.max_tokens, args.rounds) < 1:
        parser.error("--clients, --requests, --max-tokens and --rounds must be at least 1")
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    import edgemoe
    trees = {"before": load_tree("edgemoe_before", args.before.resolve()), "after": edgemoe}
    models = {name: package.load(args.store, threads=args.threads, ram="auto", dense_bits="auto")
              for name, package in trees.items()}
    for name in trees:   # warm-up
        serve_round(trees[name], models[name], args.clients, args.requests, args.max_tokens)
    for round_ in range(1, args.rounds + 1):
        for name, package in trees.items():
            wall, tokens, steps = serve_round(package, models[name], args.clients, args.requests, args.max_tokens)
            print(f"round {round_} {name}: {tokens / wall:.1f} tok/s ({tokens} tokens in {wall:.1f} s, {steps} steps)",
                  flush=True)


if __name__ == "__main__":
    main()
