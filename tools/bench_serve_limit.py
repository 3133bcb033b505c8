#!/usr/bin/env python
"""`edgemoe serve` inside a cgroup memory limit, under concurrent requests: does it survive, and how long
do the requests take?

    python tools/bench_serve_limit.py STORE --limit 1GiB [--requests 8] [--prompt-tokens 1000] \\
        [--max-tokens 32] [--temperature 0] [--stop STR ...] [--max-batch 16] [--serve-args "--context 8192"] \\
        [--before TREE] [--rounds 1] [--json OUT]

The server (`edgemoe serve STORE --ram auto`) starts inside a fresh cgroup v1 memory group of that
limit (the whole process charged, page cache included), the store's files dropped from the page cache
first. Once it answers, `--requests` completions are sent at once, each a prompt of about
`--prompt-tokens` tokens (a text repeated, cut by the store's tokenizer) and `max_tokens`
`--max-tokens`, greedy, or at `--temperature` with request i's seed i, ending at any `--stop`
string: with `--max-tokens` at the served context, answers whose lengths the server cannot know
ahead, as a chat client's without max_tokens. Reported per server: whether the limit killed it
(exit 137 or -9), the requests answered, the seconds until the last answer and to an answer on
average, each answer's tokens, how many times the log says a request waited for memory or was
paused, the context the log says it serves where shortened, the group's peak and how often it hit
the limit (memory.failcnt). --serve-args are added to every server's command line. --before TREE
also runs another source tree (PYTHONPATH=TREE) the same way, after this tree's, `--rounds` times,
alternated (run the script from outside both trees). Needs Linux, root and the cgroup v1 memory controller.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from edgemoe.bench import CGROUP_V1_MEMORY, drop_store_from_page_cache, remove_memory_group
from edgemoe.options import parse_bytes
from edgemoe.tokenizer import Tokenizer

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ")
START_SECONDS = 600   # loading, and compiling the kernels on a first run


def prompt_of(store: Path, tokens: int) -> str:
    tokenizer = Tokenizer(store)
    ids = tokenizer.encode(TEXT * (tokens // 8 + 1))[:tokens]
    return tokenizer.decode(ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, answers: list, i: int) -> None:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=3600) as response:
            answers[i] = (response.status, json.load(response)["usage"]["completion_tokens"], time.time())
    except urllib.error.HTTPError as e:
        answers[i] = (e.code, 0, time.time())
    except OSError as e:   # the server died
        answers[i] = (type(e).__name__, 0, time.time())


def wait_until_up(base: str, server: subprocess.Popen) -> bool:
    deadline = time.time() + START_SECONDS
    while time.time() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(base + "/v1/models", timeout=5).close()
            return True
        except OSError:
            time.sleep(1)
    return False


def serve_in_limit(args, tree: str | None, run_id: int) -> dict:
    drop_store_from_page_cache(args.store)
    group = CGROUP_V1_MEMORY / f"edgemoe-serve-{os.getpid()}-{run_id}"
    group.mkdir()
    port = free_port()
    log = Path(f"/tmp/edgemoe-serve-{os.getpid()}-{run_id}.log")
    try:
        (group / "memory.limit_in_bytes").write_text(str(parse_bytes(args.limit, "--limit")))
        env = f"PYTHONPATH={tree} " if tree else ""
        command = (f"{env}exec {sys.executable} -m edgemoe serve {args.store} --port {port} "
                   f"--max-batch {args.max_batch} --ram auto {args.serve_args}")
        with log.open("w") as out:
            server = subprocess.Popen(["sh", "-c", f"echo $$ > {group}/cgroup.procs && {command}"],
                                      stdout=out, stderr=subprocess.STDOUT)
            base = f"http://127.0.0.1:{port}"
            up = wait_until_up(base, server)
            answers: list = [None] * args.requests
            start = time.time()
            if up:
                threads = [threading.Thread(target=post, args=(base + "/v1/completions", request_body(args, i),
                                                               answers, i))
                           for i in range(args.requests)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            killed = server.poll() in (137, -9)
            server.terminate()
            server.wait()
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        hits = int((group / "memory.failcnt").read_text())
    finally:
        remove_memory_group(group)
    text = log.read_text()
    log.unlink()
    answered = [a for a in answers if a is not None and a[0] == 200]
    return {"tree": tree or "this", "limit": args.limit, "up": up, "killed": killed,
            "answered": len(answered), "requests": args.requests,
            "seconds_to_last": max((a[2] for a in answered), default=start) - start,
            "mean_seconds_to_answer": sum(a[2] - start for a in answered) / max(len(answered), 1),
            "completion_tokens": sum(a[1] for a in answered), "answer_tokens": [a[1] if a else None for a in answers],
            "waited_for_memory": text.count("waits for memory"), "paused": text.count("paused for memory"),
            "context": next((line.split("serving a context of ")[1].split(" ")[0] for line in text.splitlines()
                             if "serving a context of " in line), "the model's"),
            "statuses": sorted({str(a[0]) for a in answers if a is not None}), "peak_bytes": peak,
            "limit_hits": hits, "log_tail": text.splitlines()[-12:]}


def request_body(args, i: int) -> dict:
    body = {"prompt": args.prompt, "temperature": args.temperature, "max_tokens": args.max_tokens,
            "seed": i if args.temperature > 0 else None, "stop": args.stop or None}
    return {k: v for k, v in body.items() if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path)
    parser.add_argument("--limit", required=True, help="cgroup memory limit (page cache counted)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat for more)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--serve-args", default="", help="more options for every server, e.g. '--context 8192'")
    parser.add_argument("--before", default=None, help="another source tree, run the same way after this one")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if not (CGROUP_V1_MEMORY / "cgroup.procs").exists():
        raise SystemExit(f"no cgroup v1 memory controller at {CGROUP_V1_MEMORY}")
    args.prompt = prompt_of(args.store, args.prompt_tokens)
    runs = []
    trees = [None] + ([args.before] if args.before else [])
    for run_id, tree in enumerate(trees * args.rounds):
        runs.append(serve_in_limit(args, tree, run_id))
        r = runs[-1]
        print(f"{r['tree']}: {'killed' if r['killed'] else 'alive'}, {r['answered']}/{r['requests']} answered "
              f"({', '.join(r['statuses'])}) in {r['seconds_to_last']:.0f} s (mean {r['mean_seconds_to_answer']:.0f} s), "
              f"{r['completion_tokens']} tokens "
              f"{r['answer_tokens']}; {r['waited_for_memory']} waited for memory, {r['paused']} paused; "
              f"context {r['context']}; peak {r['peak_bytes'] / 2**20:.0f} MiB, limit hit {r['limit_hits']} times",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
