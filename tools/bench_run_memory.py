#!/usr/bin/env python
"""What an `edgemoe run` holds, over time, as a cgroup charges it: where --ram auto's reserves go.

    python tools/bench_run_memory.py STORE --ram 127MiB [--limit 8GiB] [--tokens 40] [--flags '...'] [--json OUT]

The run (`edgemoe run STORE -p PROMPT -n TOKENS --stats --ram R`) starts inside a fresh cgroup v1
memory group whose limit (default 8 GiB) is far above what it takes, so nothing is reclaimed and the
charge is what the run asks for. The store's files are dropped from the page cache first. Every 20 ms
the group's memory.usage_in_bytes and memory.stat (anonymous memory `rss`, page cache `cache`, of which
`mapped_file`) are sampled, with the process's VmRSS; the first byte the run writes to stdout (the
prompt's echo, unbuffered) marks the end of the load. The table gives each phase's peak: the anonymous
peak is what no reclaim can lower, so a limit must hold it plus whatever page cache the run keeps
active. "After the load" is the first sample at or after that mark, and "generation's growth" the
generation's anonymous peak less it: with `--ram 0` (no expert cached), what the run holds besides
its dense weights and cached experts (KV cache, activations, read buffers, runtime), which --ram auto
reserves. Needs Linux, root and the cgroup v1 memory controller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from edgemoe.bench import CGROUP_V1_MEMORY, drop_store_from_page_cache, remove_memory_group
from edgemoe.options import parse_bytes

PROMPT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
          "foolishness, it was the epoch of belief")
MIB = 2 ** 20
SAMPLE_SECONDS = 0.02


def read_stat(group: Path) -> dict[str, int]:
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    return {"usage": int((group / "memory.usage_in_bytes").read_text()), "rss": int(stat["rss"]),
            "cache": int(stat["cache"]), "mapped_file": int(stat["mapped_file"])}


def vm_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sample_until_done(group: Path, process: subprocess.Popen, start: float) -> list[dict]:
    samples = []
    while process.poll() is None:
        try:
            record = read_stat(group)
        except (OSError, KeyError, ValueError):   # the group is being torn down
            break
        record.update(t=time.monotonic() - start, vm_rss=vm_rss(process.pid))
        samples.append(record)
        time.sleep(SAMPLE_SECONDS)
    return samples


def first_output_time(stream, start: float, marks: dict, captured: list[bytes]) -> None:
    first = stream.read(1)
    if first:
        marks["first_output"] = time.monotonic() - start
        captured.append(first)
    captured.append(stream.read())


def measure(args) -> dict:
    drop_store_from_page_cache(Path(args.store))
    group = CGROUP_V1_MEMORY / f"edgemoe-run-memory-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(parse_bytes(args.limit, "--limit")))
        command = [sys.executable, "-u", "-m", "edgemoe", "run", args.store, "-p", PROMPT, "-n", str(args.tokens),
                   "--stats", "--ram", args.ram, *args.flags.split()]
        start = time.monotonic()
        process = subprocess.Popen(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *command],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        marks, out, err = {}, [], []
        readers = [threading.Thread(target=first_output_time, args=(process.stdout, start, marks, out)),
                   threading.Thread(target=lambda: err.append(process.stderr.read()))]
        for reader in readers:
            reader.start()
        samples = sample_until_done(group, process, start)
        for reader in readers:
            reader.join()
        peak = int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        remove_memory_group(group)
    return {"store": args.store, "ram": args.ram, "rc": process.returncode, "max_usage": peak, "marks": marks,
            "stats": [line for line in b"".join(err).decode(errors="replace").splitlines() if "[stats]" in line],
            "samples": samples}


def phase_peaks(run: dict) -> list[tuple[str, dict]]:
    loaded = run["marks"].get("first_output", float("inf"))
    phases = [("load", [s for s in run["samples"] if s["t"] < loaded]),
              ("generation", [s for s in run["samples"] if s["t"] >= loaded])]
    return [(name, {key: max(s[key] for s in part) for key in ("usage", "rss", "cache", "mapped_file", "vm_rss")})
            for name, part in phases if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--ram", required=True, help="the run's --ram")
    parser.add_argument("--limit", default="8GiB", help="the group's limit: far above the run's needs")
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--flags", default="", help="more flags for the run, e.g. '--policy lru --preload none'")
    parser.add_argument("--json", type=Path, default=None, help="also write the samples here")
    args = parser.parse_args()
    if not (CGROUP_V1_MEMORY / "cgroup.procs").exists():
        raise SystemExit(f"no cgroup v1 memory controller at {CGROUP_V1_MEMORY}")
    run = measure(args)
    print(f"{args.store} --ram {args.ram}: exit {run['rc']}, group peak {run['max_usage'] / MIB:.0f} MiB, "
          f"first output at {run['marks'].get('first_output', float('nan')):.2f} s; "
          f"load average {os.getloadavg()[0]:.2f}")
    for line in run["stats"]:
        print(" ", line)
    print("\n| phase | usage | anonymous (rss) | page cache | of it mapped | VmRSS |")
    print("|---|---:|---:|---:|---:|---:|")
    peaks = dict(phase_peaks(run))
    for name, peak in peaks.items():
        print(f"| {name} | " + " | ".join(f"{peak[k] / MIB:.0f}" for k in ("usage", "rss", "cache", "mapped_file", "vm_rss"))
              + " |")
    loaded = run["marks"].get("first_output")
    after = next((s for s in run["samples"] if loaded is not None and s["t"] >= loaded), None)
    if after is not None and "generation" in peaks:
        print(f"\nafter the load: anonymous {after['rss'] / MIB:.0f} MiB, VmRSS {after['vm_rss'] / MIB:.0f} MiB; "
              f"generation's growth: anonymous {(peaks['generation']['rss'] - after['rss']) / MIB:.0f} MiB, "
              f"VmRSS {(peaks['generation']['vm_rss'] - after['vm_rss']) / MIB:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(run))


if __name__ == "__main__":
    main()
