#!/usr/bin/env python
"""--ram auto against hand-picked RAM budgets, inside cgroup memory limits: does auto run, and how close
does it come to the best budget a user could have picked by trying?

    python tools/bench_ram_auto.py STORE --limit 1GiB 1536MiB --ram auto 10% 25% 50% 75% \\
        [--tokens 40] [--rounds 1] [--json OUT] [--before TREE]

Each run is `edgemoe run STORE -p PROMPT -n TOKENS --stats --ram R` started inside a fresh cgroup v1
memory group of that limit (the whole process charged, page cache included, as under systemd-run or a
container), the store's files dropped from the page cache first. A run the limit kills exits 137 (or
-9) and is reported as killed. Within a round the budgets run in the order given, limit by limit. A
row gives the decode tokens/s `--stats` printed (median of its rounds), the group's peak and how often
it hit the limit (memory.failcnt); "vs best" divides auto's speed by the best hand-picked budget's
that no round saw killed. --before TREE also runs `--ram auto` of another source tree (PYTHONPATH=TREE)
right after this tree's in every round, as the row "auto, before" (run the script from outside both
trees, so that `python -m` does not import the working directory's). Needs Linux, root and the cgroup
v1 memory controller.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edgemoe.bench import CGROUP_V1_MEMORY, drop_store_from_page_cache, remove_memory_group
from edgemoe.options import parse_bytes

PROMPT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
          "foolishness, it was the epoch of belief")


BEFORE = "auto, before"


def run_in_limit(store: str, limit: str, ram: str, args, run_id: int) -> dict:
    drop_store_from_page_cache(Path(store))
    group = CGROUP_V1_MEMORY / f"edgemoe-ram-auto-{os.getpid()}-{run_id}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(parse_bytes(limit, "--limit")))
        tree = f"PYTHONPATH={args.before} " if ram == BEFORE else ""
        command = " ".join([sys.executable, "-m", "edgemoe", "run", store, "-p", repr(PROMPT), "-n",
                            str(args.tokens), "--stats", "--ram", "auto" if ram == BEFORE else ram])
        done = subprocess.run(["sh", "-c", f"echo $$ > {group}/cgroup.procs && {tree}exec {command}"],
                              capture_output=True, text=True)
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        hits = int((group / "memory.failcnt").read_text())
    finally:
        remove_memory_group(group)
    record = {"limit": limit, "ram": ram, "rc": done.returncode, "peak_bytes": peak, "limit_hits": hits}
    decode = re.search(r"decode \d+ tokens: ([\d.]+) tok/s", done.stdout + done.stderr)
    auto = re.search(r"--ram auto: ([\d.]+ \w+) of", done.stdout + done.stderr)
    if done.returncode == 0 and decode:
        record["decode_tok_s"] = float(decode.group(1))
        record["experts_in_ram"] = auto.group(1) if auto else ram
        grown = re.search(r"--ram auto, after (\d+) tokens: grown by [\d.]+ \w+ to ([\d.]+ \w+)", done.stderr)
        if grown:
            record["experts_in_ram"] += f" -> {grown.group(2)} (token {grown.group(1)})"
    elif done.returncode == 0:
        record["rc"] = f"no decode figure: {done.stderr.strip()[-200:]}"
    return record


def print_table(runs: list[dict], limits: list[str], rams: list[str]) -> None:
    print("\n| limit | --ram | experts in RAM | decode tok/s (rounds) | peak MiB | vs best hand-picked |")
    print("|---|---|---|---|---:|---:|")
    for limit in limits:
        rows = {}
        for ram in rams:
            mine = [r for r in runs if r["limit"] == limit and r["ram"] == ram]
            ok = [r for r in mine if "decode_tok_s" in r]
            rows[ram] = (statistics.median(r["decode_tok_s"] for r in ok) if len(ok) == len(mine) else None, mine)
        best = max((speed for ram, (speed, _) in rows.items() if not ram.startswith("auto") and speed is not None),
                   default=None)
        for ram, (speed, mine) in rows.items():
            speeds = ", ".join(f"{r['decode_tok_s']:.2f}" if "decode_tok_s" in r else f"killed ({r['rc']})"
                               for r in mine)
            size = "/".join(sorted({r.get("experts_in_ram", "-") for r in mine}))
            peak = max(r["peak_bytes"] for r in mine) / 2**20
            ratio = f"{speed / best:.2f}x" if speed is not None and best else "-"
            print(f"| {limit} | {ram} | {size} | {speeds} | {peak:.0f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--limit", nargs="+", required=True, help="cgroup memory limits (page cache counted)")
    parser.add_argument("--ram", nargs="+", default=["auto", "10%", "25%", "50%", "75%"])
    parser.add_argument("--tokens", type=int, default=40, help="tokens generated per run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write every run here")
    parser.add_argument("--before", type=Path, default=None, help="a source tree whose --ram auto runs beside")
    args = parser.parse_args()
    if args.before is not None:
        if not (args.before / "edgemoe" / "__init__.py").is_file():
            parser.error(f"--before {args.before}: not a source tree of edgemoe (no edgemoe/__init__.py in it)")
        args.ram.insert(args.ram.index("auto") + 1 if "auto" in args.ram else 0, BEFORE)
    if not (CGROUP_V1_MEMORY / "cgroup.procs").exists():
        raise SystemExit(f"no cgroup v1 memory controller at {CGROUP_V1_MEMORY}")
    print(f"{args.store}: edgemoe run, {args.tokens} tokens, cold, {args.rounds} round(s); started "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; load average {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for _ in range(args.rounds):
        for limit in args.limit:
            for ram in args.ram:
                record = run_in_limit(args.store, limit, ram, args, len(runs))
                runs.append(record)
                result = f"{record['decode_tok_s']:.2f} tok/s" if "decode_tok_s" in record else f"exit {record['rc']}"
                print(f"  {limit} --ram {ram}: {result}, peak {record['peak_bytes'] / 2**20:.0f} MiB, "
                      f"limit hit {record['limit_hits']} times", flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print_table(runs, args.limit, args.ram)


if __name__ == "__main__":
    main()
